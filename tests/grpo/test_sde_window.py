"""SDE windows (Flow-GRPO-Fast, MixGRPO): only a window of steps is sampled stochastically and trained, the rest
runs the ODE; composed with JAGG windows inside it."""

from pathlib import Path

import pytest
import torch

from jagg_scale.grpo import sample_sde, sigma_schedule
from jagg_scale.grpo.sde import ode_step
from jagg_scale.train import ConfigError, Trainer, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=16", "sampling.num_steps=8",
         "sampling.chunk_size=8", "train.prompts_per_step=2", "train.minibatch_size=8", "log.progress=false"]


def test_steps_outside_the_window_are_exactly_the_ode():
    torch.manual_seed(0)
    velocity = lambda x, s, c: -x * (1 + s[:, None, None, None]) + c
    cond = torch.randn(3, 1, 1, 1)
    sigmas = sigma_schedule(8, 3.0)
    gens = [torch.Generator().manual_seed(i) for i in range(3)]
    traj = sample_sde(velocity, cond, torch.randn(3, 2, 4, 4), sigmas, noise_level=0.7, generator=gens,
                      sde_steps={2, 3, 4})
    for k in range(8):
        ode = ode_step(traj.latents[k], traj.velocities[k], sigmas[k], sigmas[k + 1])
        if k in (2, 3, 4):
            assert not torch.allclose(traj.latents[k + 1], ode) and (traj.log_probs[k] != 0).all()
        else:
            assert torch.equal(traj.latents[k + 1], ode) and (traj.log_probs[k] == 0).all()


@pytest.mark.parametrize("mode", ["random", "sliding"])
def test_training_on_an_sde_window_with_jagg_inside(tmp_path, mode):
    cfg = load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "train.steps=4", "grpo.sde_window=4",
                                     "grpo.sde_window_range=[1, 7]", f"grpo.sde_window_mode={mode}",
                                     "jagg.window=4"])
    rows = Trainer(cfg).fit()
    starts = [r["sde_window_start"] for r in rows]
    assert all(1 <= s <= 3 for s in starts)
    if mode == "sliding":
        assert starts == [1, 2, 3, 1]
    for r in rows:
        assert r["per_step_equiv"] == 4 and r["windows_jagg"] == 1 and r["backward_passes"] == 2
        assert r["ratio_mean"] == pytest.approx(1.0, abs=1e-4)  # the training pass rescores the window's SDE steps


def test_scattered_sde_steps_are_any_of_the_range_drawn_per_step(tmp_path):
    """grpo.sde_window_mode scattered (UniRL's AllSDEScheduler, its Flow-DPPO recipe: 3 of the first 5 steps): each
    training step draws its own sde_window steps of [lo, hi) without replacement, consecutive or not, seeded by the
    step; the rollout is SDE there alone and training rescores exactly those (here under train.algorithm dppo, with
    one JAGG window over the 3 scattered steps)."""
    cfg = load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", "train.algorithm=dppo", "grpo.sde_window=3",
                                     "grpo.sde_window_range=[0, 5]", "grpo.sde_window_mode=scattered",
                                     "jagg.window=3", "run.checkpoint_every=0"])
    trainer = Trainer(cfg)
    try:
        drawn = [trainer.algorithm.trained_steps_at(step) for step in range(40)]
        assert drawn == [trainer.algorithm.trained_steps_at(step) for step in range(40)]  # seeded by the step
        assert all(len(set(d)) == 3 and d == sorted(d) and 0 <= d[0] and d[-1] <= 4 for d in drawn)
        assert any(d[-1] - d[0] > 2 for d in drawn) and len({tuple(d) for d in drawn}) > 5  # scattered, varied
        spec = trainer.algorithm.rollout_spec(0)
        traj = trainer.policy.rollout(trainer.policy.encode(["a", "b"]), torch.arange(2), 0, spec=spec)
        # the trajectory keeps the trained range alone (grpo/rollout.py): the first to the last drawn step
        span = range(drawn[0][0], drawn[0][-1] + 1)
        assert traj.first == drawn[0][0] and traj.log_probs.shape[0] == len(span) == traj.latents.shape[0] - 1
        assert [bool((traj.log_probs[q] != 0).all()) for q in traj.positions(list(span))] == [
            k in drawn[0] for k in span]
        m = trainer.train_step(0)
    finally:
        trainer.close()
    assert m["per_step_equiv"] == 3 and m["backward_passes"] == 2 and m["onpolicy_log_ratio"] < 1e-5


def test_sde_window_config_errors_name_the_key():
    for override, key in [("grpo.sde_window=9", "grpo.sde_window"),
                          ("grpo.sde_window_range=[6, 7]", "grpo.sde_window_range"),
                          ("grpo.sde_window_mode=shuffle", "grpo.sde_window_mode"),
                          ("grpo.timestep_fraction=0.5", "grpo.timestep_fraction"),
                          ("grpo.sde_window_mode=scattered sampling.ode_steps=3", "sampling.ode_steps")]:
        with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
            load_config(TINY, SMALL + ["grpo.sde_window=2", *override.split()])


def test_the_reference_runs_on_the_trained_steps_only():
    """ref_steps: the KL reference's forwards where they are used (the trained steps); the rest of the trajectory
    and the reference velocities there are those of a rollout that evaluates it everywhere."""
    torch.manual_seed(0)
    velocity = lambda x, s, c: -x * (1 + s[:, None, None, None]) + c
    calls = []
    ref = lambda x, s, c: calls.append(float(s[0])) or -0.9 * x + c
    cond, noise, sigmas = torch.randn(3, 1, 1, 1), torch.randn(3, 2, 4, 4), sigma_schedule(8, 3.0)

    def run(ref_steps):
        calls.clear()
        gens = [torch.Generator().manual_seed(i) for i in range(3)]
        return sample_sde(velocity, cond, noise, sigmas, noise_level=0.7, generator=gens, ref_velocity_fn=ref,
                          ref_steps=ref_steps), list(calls)

    (every, every_calls), (trained, trained_calls) = run(None), run({0, 1, 2, 3, 4, 5, 6})
    assert len(every_calls) == 8 and trained_calls == every_calls[:7]  # 7 of 8 forwards, at the trained sigmas
    for name in ("latents", "velocities", "log_probs"):
        assert torch.equal(getattr(every, name), getattr(trained, name)), name
    assert torch.equal(trained.ref_velocities[:7], every.ref_velocities[:7])
    assert not trained.ref_velocities[7].any() and every.ref_velocities[7].any()
