"""The trainer end to end on a very small DiT: modes, routing equivalence, `auto`, config errors, exact resume."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hang_guard import RUN_S
from jagg_scale.cli import train_main
from jagg_scale.grpo import GRPOStepLoss
from jagg_scale.jagg import fill_interior, plan_knots
from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train import runner as runner_mod
from jagg_scale.train.logging import read_metrics
from minibatch import grpo_backward, plan_of, rollout_minibatch

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")

SMALL = [
    "model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=2",
    "model.dit.num_heads=2",
    "sampling.num_steps=6", "train.prompts_per_step=2", "grpo.group_size=3", "train.minibatch_size=6",
    "log.progress=false", "run.checkpoint_every=0",
]

TIMING = ("time_rollout", "time_reward", "time_train", "time_probe")


def small_cfg(tmp_path, *extra):
    return load_config(TINY, SMALL + [f"run.output_dir={tmp_path}", *extra])


def strip_timing(rows):
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


@pytest.mark.parametrize("mode", ["exact", "jagg"])
def test_two_steps_each_mode(tmp_path, mode):
    cfg = small_cfg(tmp_path, "train.steps=2", f"jagg.mode={mode}", *["jagg.window=3"] * (mode == "jagg"))
    history = Trainer(cfg).fit()
    rows = read_metrics(tmp_path)
    assert len(rows) == 2 == len(history)
    for r in rows:
        assert r["per_step_equiv"] == 6
        assert all(torch.isfinite(torch.tensor(r[k])) for k in ("reward_mean", "loss", "grad_norm"))
        if mode == "exact":
            assert r["backward_passes"] == 6 and r["windows_jagg"] == 0
        else:  # two windows of 3 steps, each one joint pass of 2 rows-per-sample
            assert r["backward_passes"] == 4 and r["windows_jagg"] == 2 and r["backward_calls"] == 2
    assert (tmp_path / "config.yaml").exists()


def test_cli_console_script_writes_metrics(tmp_path):
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "jagg_scale.cli", TINY, "train.steps=2", f"run.output_dir={out}", *SMALL],
        capture_output=True, text=True, timeout=RUN_S,  # a hang guard only (tests/hang_guard.py)
    )
    assert proc.returncode == 0, proc.stderr
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    assert "jagg-train summary" in proc.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backward_passes"] < summary["backward_passes_per_step_baseline"]


@pytest.mark.parametrize("override,key", [
    ("jagg.windw=4", "jagg.windw"),
    ("jagg.window=four", "jagg.window"),
    ("jagg.window=0", "jagg.window"),
    ("grpo.clip_range=[1]", "grpo.clip_range"),
    ("jagg.intermediate=sometimes", "jagg.intermediate"),
    ("train.minibatch_size=5", "train.minibatch_size"),
    ("data={prompt_file: /no/such/prompts.txt}", "data.prompt_file"),  # the section: the file its one source
    ("model.pretrained=assets:nothing.safetensors", "model.pretrained"),
    ("model.kind=sd3", "model.pretrained"),
    ("model.kind=flux", "model.kind"),
    ("sampling.shift=null", "sampling.shift"),
    ("model.lora.enabled=true", "model.lora.enabled"),
    ("model.resolution=512", "model.resolution"),
])
def test_bad_config_names_the_key(tmp_path, override, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        small_cfg(tmp_path, override)
    assert train_main([TINY, override, f"run.output_dir={tmp_path / 'x'}"]) == 2
    assert not (tmp_path / "x").exists()  # failed before any work


def test_a_config_error_is_written_where_jagg_failed_file_says(tmp_path, monkeypatch, capsys):
    """slurm/jagg.sbatch sets JAGG_FAILED_FILE=OUTPUT_DIR/FAILED: a failure no retry can fix is written there (rank
    0), and the job is not requeued; unset, nothing is written anywhere."""
    marker = tmp_path / "FAILED"
    assert train_main([TINY, "jagg.widow=4", f"run.output_dir={tmp_path / 'x'}"]) == 2 and not marker.exists()
    monkeypatch.setenv("JAGG_FAILED_FILE", str(marker))
    assert train_main([TINY, "jagg.widow=4", f"run.output_dir={tmp_path / 'x'}"]) == 2
    assert marker.read_text().startswith("jagg-train exit 2: unknown config key 'jagg.widow'")
    marker.unlink()
    monkeypatch.setenv("RANK", "1")  # another rank: rank 0 writes it
    assert train_main([TINY, "jagg.widow=4", f"run.output_dir={tmp_path / 'x'}"]) == 2 and not marker.exists()


def test_bad_yaml_file_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("jagg:\n  window: 4\n  widow: 2\n")
    with pytest.raises(ConfigError, match=r"jagg\.widow"):
        load_config(bad)


def _minibatch(trainer, step=0):
    cond, batch = rollout_minibatch(trainer, step)
    return cond, batch, GRPOStepLoss(noise_level=0.7, clip_range=1e-4, scale=1 / len(trainer.algorithm.steps))


def _grads(trainer, cond, batch, loss, **kwargs):
    trainer.model.zero_grad(set_to_none=True)
    stats = grpo_backward(trainer.policy.velocity_fn(), batch, cond, loss, trainer.algorithm.steps,
                                          **plan_of(**kwargs), on_policy=True)
    return torch.cat([p.grad.flatten() for p in trainer.model.parameters()]), stats


def test_jagg_frac_zero_is_bit_identical_to_exact(tmp_path):
    trainer = Trainer(small_cfg(tmp_path))
    cond, batch, loss = _minibatch(trainer)
    exact, s_exact = _grads(trainer, cond, batch, loss, mode="exact", window=4, jagg_frac=1.0)
    zero, s_zero = _grads(trainer, cond, batch, loss, mode="jagg", window=4, jagg_frac=0.0)
    full, s_full = _grads(trainer, cond, batch, loss, mode="jagg", window=4, jagg_frac=1.0)
    assert torch.equal(exact, zero)
    assert s_zero.windows_jagg == 0 and s_exact.backward_passes == s_zero.backward_passes == 6
    assert not torch.equal(exact, full) and s_full.backward_passes == 4
    cos = torch.nn.functional.cosine_similarity(exact, full, dim=0)
    assert cos > 0.5  # an approximation of the same gradient, not noise


def test_auto_uses_cached_then_forward(tmp_path, monkeypatch):
    seen = []
    real = runner_mod.knot_backward

    def spy(*args, **kwargs):
        seen.append(kwargs["intermediate"])
        return real(*args, **kwargs)

    monkeypatch.setattr(runner_mod, "knot_backward", spy)
    # 6 samples, minibatches of 3: two optimizer steps per rollout, two windows of 3 steps each
    cfg = small_cfg(tmp_path, "train.steps=1", "train.minibatch_size=3", "jagg.window=3", "jagg.intermediate=auto")
    rows = Trainer(cfg).fit()
    assert seen == ["cached", "forward"]  # one engine call per minibatch (its two windows)
    assert rows[0]["intermediate_forward"] == 2 and rows[0]["nograd_forward_passes"] == 2
    assert rows[0]["optimizer_steps"] == 2


def test_inner_epochs_are_off_policy_after_the_first_update(tmp_path, monkeypatch):
    seen = []
    real = runner_mod.knot_backward
    monkeypatch.setattr(runner_mod, "knot_backward",
                        lambda *a, **k: seen.append(k["intermediate"]) or real(*a, **k))
    cfg = small_cfg(tmp_path, "train.steps=1", "grpo.inner_epochs=2", "jagg.window=6")
    Trainer(cfg).fit()
    assert seen == ["cached", "forward"]


def test_resume_auto_continues_exactly(tmp_path):
    common = ["train.steps=4", "run.checkpoint_every=2", "grpo.kl_beta=0.01", "jagg.window=3"]
    full_dir, cut_dir = tmp_path / "full", tmp_path / "cut"
    Trainer(load_config(TINY, SMALL + common + [f"run.output_dir={full_dir}"])).fit()
    # "interrupted": the same run stopped after step 2 (its checkpoint at 2 is complete) ...
    Trainer(load_config(TINY, SMALL + common + ["train.steps=2", f"run.output_dir={cut_dir}"])).fit()
    # ... a crashed run may have logged a step past its checkpoint: resume must rewrite it, not duplicate it
    with (cut_dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 2, "reward_mean": 123.0}) + "\n")
    resumed = Trainer(load_config(TINY, SMALL + common + ["run.resume=auto", f"run.output_dir={cut_dir}"]))
    assert resumed.start_step == 2
    resumed.fit()
    full, cut = strip_timing(read_metrics(full_dir)), strip_timing(read_metrics(cut_dir))
    assert [r["step"] for r in cut] == [0, 1, 2, 3]
    assert full == cut
    assert full[-1]["kl"] > 0  # the reference model was carried through the checkpoint too


def test_resume_auto_without_checkpoint_starts_fresh(tmp_path):
    trainer = Trainer(small_cfg(tmp_path, "run.resume=auto"))
    assert trainer.start_step == 0


@pytest.mark.parametrize("extra", ["sampling.guidance=3.0", "model.dtype=bfloat16"])
def test_cfg_guidance_and_bf16_train(tmp_path, extra):
    cfg = small_cfg(tmp_path, "train.steps=1", extra)
    rows = Trainer(cfg).fit()
    assert rows[0]["windows_jagg"] > 0 and torch.isfinite(torch.tensor(rows[0]["grad_norm"]))


def test_probe_is_one_for_w2_and_does_not_change_the_update(tmp_path):
    base = ["train.steps=2", "jagg.window=2"]
    plain = Trainer(small_cfg(tmp_path / "a", *base)).fit()
    probed_trainer = Trainer(small_cfg(tmp_path / "b", *base, "jagg.probe_every=1"))
    probed = probed_trainer.fit()
    for r in probed:
        assert r["probe_cos"] == pytest.approx(1.0, abs=1e-6)
        assert r["probe_norm_ratio"] == pytest.approx(1.0, abs=1e-5)
        assert r["probe_cos_w0"] == pytest.approx(1.0, abs=1e-6)
    drop = lambda rows: [{k: v for k, v in r.items() if not k.startswith("probe") and k not in TIMING} for r in rows]
    assert drop(plain) == drop(probed)


def test_probe_sees_the_approximation_at_larger_windows(tmp_path):
    rows = Trainer(small_cfg(tmp_path, "train.steps=1", "jagg.window=6", "jagg.probe_every=1")).fit()
    assert 0.0 < rows[0]["probe_cos"] < 1.0 - 1e-6
    assert rows[0]["probe_cos"] == pytest.approx(rows[0]["probe_cos_w0"])


def test_eval_before_after_and_jagg_eval_on_checkpoint(tmp_path):
    from jagg_scale.cli import eval_main

    ev = ["eval.enabled=true", "eval.prompts=[a red apple, a blue sky]", "eval.num_per_prompt=2"]
    trainer = Trainer(small_cfg(tmp_path / "run", "train.steps=2", *ev))
    trainer.fit()
    assert sorted(trainer.evals) == [0, 2]
    for step in (0, 2):
        d = tmp_path / "run" / "eval" / f"step_{step:08d}"
        assert (d / "grid.png").stat().st_size > 0
        assert json.loads((d / "eval.json").read_text())["num_images"] == 4
    # jagg-eval on the run dir picks its newest checkpoint and reproduces the in-run evaluation exactly
    out = tmp_path / "eval_out"
    argv = [TINY, *SMALL, *ev, "--checkpoint", str(tmp_path / "run"), "--output", str(out)]
    assert eval_main(argv) == 0
    again = json.loads((out / "eval.json").read_text())
    assert again["reward_mean"] == trainer.evals[2]["reward_mean"]
    assert again["per_prompt"] == trainer.evals[2]["per_prompt"]
    assert eval_main([TINY, *SMALL, *ev, "--checkpoint", str(tmp_path / "nothing")]) == 2


def test_wandb_offline_run_is_written(tmp_path):
    Trainer(small_cfg(tmp_path, "train.steps=1", "log.wandb=true")).fit()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


@pytest.mark.parametrize("jagg_cfg", [dict(mode="exact"), dict(window=3), dict(window=3, share_knots=True),
                                      dict(planner="budget", speedup=2.0)], ids=["exact", "W3", "shared", "budget"])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_micro_batched_gradient_is_the_whole_minibatch_gradient(tmp_path, jagg_cfg, micro):
    trainer = Trainer(small_cfg(tmp_path))
    cond, batch, _ = _minibatch(trainer)
    loss = GRPOStepLoss(noise_level=0.7, clip_range=1e-4, scale=1 / len(trainer.algorithm.steps), denominator=6.0)
    grads, calls = {}, {}
    for size in (0, micro):
        trainer.model.zero_grad(set_to_none=True)
        lasts = []

        def backward(out, grad, *, last, lasts=lasts):
            lasts.append(last)
            out.backward(grad)

        stats = grpo_backward(trainer.policy.model_fn(), batch, cond, loss, trainer.algorithm.steps,
                                              **plan_of(**jagg_cfg), on_policy=True, backward=backward,
                                              micro_batch_size=size)
        grads[size] = torch.cat([p.grad.flatten() for p in trainer.model.parameters()])
        calls[size] = stats.backward_calls
        assert lasts == [False] * (len(lasts) - 1) + [True]  # one accumulation boundary: the very last backward
    chunks = -(-6 // micro)
    assert calls[micro] == calls[0] * chunks
    assert float((grads[micro] - grads[0]).norm() / grads[0].norm()) <= 1e-6


def test_the_rollout_runs_the_reference_at_the_trained_steps_only(tmp_path):
    """Flow-GRPO's timestep_fraction 0.5 trains 3 of the 6 steps: the KL reference is called there alone, once per
    rollout chunk, and the step trains as before."""
    t = Trainer(small_cfg(tmp_path, "grpo.kl_beta=0.04", "grpo.timestep_fraction=0.5", "sampling.chunk_size=6"))
    try:
        inner, sigmas = t.policy.reference_fn, []
        t.policy.reference_fn = lambda: (lambda f: (lambda x, s, c: sigmas.append(float(s[0])) or f(x, s, c)))(
            inner())
        m = t.train_step(0)
    finally:
        t.close()
    steps = t.algorithm.steps
    assert steps == [0, 1, 2] and sigmas == [float(t.policy.sigmas[k]) for k in steps]
    assert m["optimizer_steps"] == 1 and torch.isfinite(torch.tensor(m["loss"]))


@pytest.mark.parametrize("extra,knots", [(["jagg.window=4"], [0, 3, 4, 5]),  # windows [0-3] [4-5]
                                         (["jagg.window=3", "jagg.share_knots=true"], [0, 2, 4, 5])])
def test_ref_at_knots_runs_the_reference_at_the_knots_and_fills_the_rest(tmp_path, extra, knots):
    """grpo.ref_at knots: the rollout calls the KL reference at the plan's knots only (6 trained steps), the other
    trained steps' reference velocities are the knots' blend in sigma, and the trajectory itself, the knots'
    reference velocities and the step's plan are those of ref_at steps."""
    def rollout(ref_at):
        t = Trainer(small_cfg(tmp_path / ref_at, "grpo.kl_beta=0.04", "sampling.chunk_size=6", *extra,
                              f"grpo.ref_at={ref_at}"))
        calls = []
        inner = t.policy.reference_fn
        t.policy.reference_fn = lambda: (lambda f: (lambda x, s, c: calls.append(float(s[0])) or f(x, s, c)))(
            inner())
        spec = t.algorithm.rollout_spec(0)  # the trained steps 0-5 and the reference's knots among them
        assert spec.ref_steps == {spec.trained[q] for q in plan_knots(spec.ref_plan)}
        traj = t.policy.rollout(t.policy.encode(["a", "b"] * 3), torch.arange(6), 0, spec=spec)
        seen = list(calls)
        m = t.train_step(0)  # the trainer's own rollout makes the same calls
        t.close()
        assert calls == seen + seen
        return t, traj, seen, m

    t, full, calls_all, m_all = rollout("steps")
    t_knots, part, calls, m = rollout("knots")
    sig = [float(s) for s in t.policy.sigmas]
    assert calls_all == sig[:6] and calls == [sig[k] for k in knots]
    assert torch.equal(part.latents, full.latents) and torch.equal(part.log_probs, full.log_probs)
    assert torch.equal(part.ref_velocities[knots], full.ref_velocities[knots])
    plan = t_knots.algorithm.rollout_spec(0).ref_plan
    assert plan_knots(plan) == knots
    assert torch.allclose(part.ref_velocities[:6], fill_interior(plan, full.ref_velocities[:6], full.sigmas[:6]))
    inner = [k for k in range(6) if k not in knots]
    assert not torch.allclose(part.ref_velocities[inner], full.ref_velocities[inner])  # an approximation
    assert m["backward_passes"] == m_all["backward_passes"] and m["kl"] != m_all["kl"]


@pytest.mark.parametrize("override", [["jagg.mode=exact"], ["jagg.jagg_frac=0.5"], ["jagg.min_cos=0.5"],
                                      ["jagg.planner=budget"], ["grpo.kl_beta=0"]])
def test_ref_at_knots_needs_a_reference_and_windows_known_before_the_rollout(tmp_path, override):
    with pytest.raises(ConfigError, match="config key 'grpo.ref_at'"):
        small_cfg(tmp_path, "grpo.kl_beta=0.04", "grpo.ref_at=knots", *override)
    with pytest.raises(ConfigError, match="config key 'grpo.ref_at'"):
        small_cfg(tmp_path, "train.algorithm=nft", "grpo.ref_at=knots")
