"""GCPO in the trainer (train.algorithm gcpo, train/gcpo.py): each row's own chunks, the factors on- and off-policy,
one JAGG window per chunk (exact for chunks of <= 2 steps: the probe's cosine), micro-batches, exact resume, LoRA
with CFG, and the config's refusals by key."""

from pathlib import Path

import pytest
import torch

from jagg_scale.cond import index_cond
from jagg_scale.train import ConfigError, Trainer, load_config
from jagg_scale.train.logging import read_metrics

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
# 6 steps: 5 candidates in chunks [2, 1, 2], each row trains int(3 x 0.67) = 2 of them in slots of P = 2
GCPO = ["train.algorithm=gcpo", "gcpo.chunks=[2, 1, 2]", "gcpo.chunk_fraction=0.67", "jagg.window=2",
        "model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=8", "model.dit.patch_size=2",
        "sampling.num_steps=6", "train.prompts_per_step=2", "grpo.group_size=3", "train.minibatch_size=3",
        "grpo.clip_range=0.02", "log.progress=false", "run.checkpoint_every=1"]


def _strip(rows):
    return [{k: v for k, v in r.items() if not k.startswith("time_")} for r in rows]


@pytest.mark.slow
def test_gcpo_trains_with_exact_chunk_windows_and_resumes_exactly(tmp_path):
    over = GCPO + ["train.micro_batch_size=2", "jagg.probe_every=1"]
    full = Trainer(load_config(TINY, over + [f"run.output_dir={tmp_path / 'full'}", "train.steps=2"]))
    rows = full.fit()
    full.close()
    for r in rows:
        # 6 rows in 2 minibatches of 3, 2 chunk slots of 2 positions: one joint pass per chunk = 2 knots per slot
        assert r["optimizer_steps"] == 2 and r["per_step_equiv"] == 4 * 2 and r["backward_passes"] == 4 * 2
        assert r["probe_cos"] == pytest.approx(1.0, abs=1e-5)  # windows of <= 2 steps: JAGG is the exact gradient
        assert r["onpolicy_log_ratio"] < 1e-5  # the first minibatch's knots reproduce the rollout's log-probs
        # the second minibatch's factors: a fresh no-grad forward of each row's real chunk steps (3 or 4 of its 4
        # positions: a lone step's slot ends in a phantom knot) after the first optimizer step, in B-row passes
        assert 3 <= r["nograd_forward_passes"] <= 4
        assert 0 < r["chunk_ratio_mean"] and r["chunk_ratio_min"] <= 1 <= r["chunk_ratio_max"]
        assert 0 <= r["chunk_clipfrac"] <= 0.5
    assert any(r["chunk_clipfrac"] > 0 for r in rows) or any(r["chunk_ratio_max"] > 1 for r in rows)
    Trainer(load_config(TINY, over + [f"run.output_dir={tmp_path / 'cut'}", "train.steps=1"])).fit()
    resumed = Trainer(load_config(TINY, over + [f"run.output_dir={tmp_path / 'cut'}", "train.steps=2",
                                                "run.resume=auto"]))
    assert resumed.start_step == 1
    resumed.fit()
    resumed.close()
    assert _strip(read_metrics(tmp_path / "cut")) == _strip(read_metrics(tmp_path / "full"))


def test_a_window_of_a_longer_chunk_approximates_and_the_exact_plan_does_not(tmp_path):
    """Chunks [3, 2] in slots of 3: the JAGG window of the 3-step chunk interpolates its middle step's Jacobian (the
    probe's cosine below 1); jagg.mode exact trains the same minibatches per step, pads included."""
    over = GCPO[4:] + ["train.algorithm=gcpo", "gcpo.chunks=[3, 2]", "gcpo.chunk_fraction=0.5", "train.steps=1",
                       "train.minibatch_size=6"]
    rows = Trainer(load_config(TINY, over + ["jagg.window=3", "jagg.probe_every=1",
                                             f"run.output_dir={tmp_path / 'jagg'}"])).fit()
    assert rows[0]["backward_passes"] == 2 and rows[0]["per_step_equiv"] == 3
    assert 0.5 < rows[0]["probe_cos"] < 1 - 1e-6
    exact = Trainer(load_config(TINY, over + ["jagg.mode=exact", f"run.output_dir={tmp_path / 'exact'}"])).fit()
    assert exact[0]["backward_passes"] == 3 and exact[0]["reward_mean"] == rows[0]["reward_mean"]


def test_off_policy_factors_come_from_the_current_weights_at_every_real_step(tmp_path):
    """After an optimizer step a minibatch's velocities are the current model's at every real chunk step (packed into
    calls of train.micro_batch_size rows), and its factors GCPO's at those: the log-ratios the per-step plan would
    meet. Pads keep the rollout's values (their terms weigh 0)."""
    from jagg_scale.gcpo import chunk_factor
    from jagg_scale.grpo.advantages import Advantages
    from jagg_scale.train.rows import StepRows

    t = Trainer(load_config(TINY, GCPO + ["train.micro_batch_size=2", f"run.output_dir={tmp_path}"]))
    try:
        unit, N = t.algorithm, 6
        rows = StepRows.draw(N, 3, 0, 0, 0, 1)
        cond = index_cond(t.policy.encode(["a red apple"] * 3 + ["a blue sky"] * 3), rows.mine)  # the rank's order
        traj = t.policy.rollout(cond, rows.mine, 0, spec=unit.rollout_spec(0))
        with torch.no_grad():  # the weights move away from the rollout's
            for p in t.engine.params:
                p.add_(0.05 * torch.randn_like(p))
        adv = Advantages(values=torch.tensor([1.0, -1.0, 0.5, 2.0, -2.0, 0.1]), mask=torch.ones(N, dtype=torch.bool),
                         zero_std_groups=0, num_groups=2)
        local, global_rows = rows.minibatches(0, 0, 0)[1]
        mb = unit._minibatches(traj, cond, None, adv, rows, 0, unit.steps, 1.0)(
            0, local, global_rows, False)
        b, fn = mb.batch, t.policy.model_fn()
        real = b.real[0::2]
        with torch.no_grad():
            for q, k in enumerate(mb.positions):
                want = fn(b.latents[k], b.sigmas[k], index_cond(cond, local)).float()
                assert torch.allclose(b.velocities[k][real[q]], want[real[q]], atol=1e-5)
            lp = torch.stack([mb.loss.transition(b, k, b.velocities[k]).log_prob for k in mb.positions])
        m = ((lp - b.log_probs[0::2]) * real).reshape(2, 2, 3).sum(1) / real.reshape(2, 2, 3).sum(1)
        _, f = chunk_factor(m, b.advantages, 0.02)
        assert m.abs().max() > 1e-3 and mb.nograd_forward_passes == -(-int(real.sum()) // 3)
        got = b.factor[0::2].reshape(2, 2, 3)  # F_k = f_c / (n_c n denominator) at a chunk's real steps
        n_c = real.reshape(2, 2, 3).sum(1)
        assert torch.allclose(got[:, 0], f / (n_c * 2 * 3), atol=1e-7)
    finally:
        t.close()


@pytest.mark.slow
def test_gcpo_with_lora_and_cfg_refreshes_both_branches_after_an_update(sd3_dir, tmp_path):
    cfg = load_config(ROOT / "configs" / "sd3_tiny_cpu.yaml", [
        f"model.pretrained={sd3_dir}", "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8",
        "train.algorithm=gcpo", "sampling.num_steps=4", "gcpo.chunks=[]", "gcpo.chunk_size=2",
        "gcpo.chunk_fraction=1.0", "jagg.window=2", "train.steps=1", "train.minibatch_size=4",
        f"run.output_dir={tmp_path}", "log.progress=false", "eval.enabled=false"])
    trainer = Trainer(cfg)
    rows = trainer.fit()
    # 3 candidates in chunks [2, 1], both trained: 2 slots of 2; the second minibatch refreshes the conditional and
    # the unconditional prediction at each row's 3 real steps (the lone step's phantom knot is not one)
    assert rows[0]["optimizer_steps"] == 2 and rows[0]["nograd_forward_passes"] == 3 * 2
    assert rows[0]["onpolicy_log_ratio"] < 1e-3 and torch.isfinite(torch.tensor(rows[0]["loss"]))
    trainer.close()


@pytest.mark.parametrize("override,key", [
    (["gcpo.chunk_fraction=0.25"], "gcpo.chunk_fraction"),  # a GCPO key on a GRPO run
    (["train.algorithm=gcpo"], "gcpo.chunks"),  # the published [2, 3, 4, 7] needs 17 steps
    (["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.window=4"], "jagg.window"),  # a window of 4 of 7
    (["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.window=7", "jagg.share_knots=true"], "jagg.share_knots"),
    (["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.planner=budget"], "jagg.planner"),
    (["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.window=7", "jagg.intermediate=interpolate"],
     "jagg.intermediate"),
    (["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.window=7", "grpo.kl_beta=0.01"], "grpo.kl_beta"),
    (["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.window=7", "grpo.timestep_fraction=0.5"],
     "grpo.timestep_fraction"),
    (["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.window=7", "grpo.step_selection=random"],
     "grpo.step_selection"),
    (["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.window=7", "grpo.sde_window=4"], "grpo.sde_window"),
    (["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.window=7", "gcpo.chunk_size=3"], "gcpo.chunk_size"),
    (["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.window=7", "gcpo.chunk_fraction=0.2"],
     "gcpo.chunk_fraction"),  # int(4 x 0.2) = 0 chunks
    (["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.window=7", "nft.mix=0.5"], "nft.mix"),
])
def test_what_gcpo_does_not_use_is_refused_naming_the_key(override, key):
    with pytest.raises(ConfigError, match=f"config key '{key}'"):
        load_config(TINY, override)
    ok = load_config(TINY, ["train.algorithm=gcpo", "sampling.num_steps=17", "jagg.window=7"])
    assert ok.trained_per_sample == 2 * 7 and not ok.uses_reference
