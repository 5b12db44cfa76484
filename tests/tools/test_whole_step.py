"""The whole_step study (tools/bench/whole_step.py): its Flow-GRPO arm trains what Flow-GRPO trains, and the study
runs end to end at toy size with every phase and the model's prices in its result."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from extras import need

need("diffusers")
need("transformers")

ROOT = Path(__file__).resolve().parents[2]

from tools.bench import whole_step as W  # noqa: E402 - after the extras check
from jagg_scale.train import Trainer, load_config  # noqa: E402

COMMON = ["grpo.kl_beta=0.04", "sampling.num_steps=4", "train.prompts_per_step=2", "grpo.group_size=4",
          "train.minibatch_size=4", "sampling.chunk_size=2", "train.micro_batch_size=2", "log.progress=false",
          "run.checkpoint_every=0", "parallel.activation_checkpointing=false", "jagg=null", "jagg.mode=exact",
          "train.lr=1e-3"]


def test_the_flow_grpo_arm_trains_flow_grpos_update(tmp_path, sd3_dir):
    """Flow-GRPO's update (one [uncond; cond] forward with grad per trained step, u detached, the reference at
    training, no rollout reference) makes the same optimizer steps as this stack's per-step mode (the conditional
    rows alone, u from the rollout and refreshed after the first optimizer step, the reference in the rollout):
    the same gradient, up to the float order of one batched forward against two (2 minibatches, CFG 4.5)."""
    def trainer(name, fg):
        t = Trainer(load_config(ROOT / "configs" / "sd3_tiny_cpu.yaml",
                                COMMON + [f"model.pretrained={sd3_dir}", f"run.output_dir={tmp_path / name}"]))
        if fg:
            t.algorithm = W.FlowGRPOUpdater(t.cfg, t.policy, t.engine, t.dist)
        return t

    ours, fg = trainer("ours", False), trainer("fg", True)
    start = {n: p.detach().clone() for n, p in ours.engine.model.named_parameters() if p.requires_grad}
    calls = []
    inner = fg.policy.reference_fn
    fg.policy.reference_fn = lambda: (lambda f: lambda x, s, c: calls.append(torch.is_grad_enabled()) or f(x, s, c))(
        inner())
    m_ours, m_fg = ours.train_step(0), fg.train_step(0)
    assert m_fg["optimizer_steps"] == m_ours["optimizer_steps"] == 2 and m_fg["backward_passes"] == 2 * 4
    assert len(calls) == 4 * 2 * 2 and not any(calls)  # per step x micro-batch x minibatch, at training, no grad
    for key in ("loss", "kl", "ratio_max", "approx_kl"):
        assert math.isclose(float(m_fg[key]), float(m_ours[key]), rel_tol=1e-3, abs_tol=1e-6), key
    moved = {n: torch.cat([(dict(t.engine.model.named_parameters())[n] - start[n]).flatten() for n in start])
             for n, t in (("ours", ours), ("fg", fg))}
    cos = torch.nn.functional.cosine_similarity(moved["ours"], moved["fg"], dim=0)
    assert cos > 0.9999 and moved["ours"].norm() > 0
    ours.close()
    fg.close()


@pytest.mark.slow
def test_the_study_runs_at_toy_size_with_every_phase_and_the_models_prices():
    res = W.run(quick=True)
    assert set(res["arms"]) == set(W.ARMS)
    for arm, r in res["arms"].items():
        assert r["step"] > 0 and r["sampling"] > 0 and r["train"] > 0, arm
        assert r["model"]["step"] > 0 and all(math.isfinite(v) for v in r["model"].values() if not isinstance(v, dict))
    fg, shipped = res["arms"]["Flow-GRPO"], res["arms"]["shipped"]
    assert fg["reference"] > 0 and fg["train_nograd"] == 0  # Flow-GRPO: the reference at training, no refresh
    assert shipped["train_nograd"] > 0 and shipped["backward_passes"] < fg["backward_passes"]
    one, fast = res["arms"]["one step a rollout"], res["arms"]["fast recipe"]
    assert one["train_nograd"] == 0  # one on-policy minibatch: nothing refreshed after an optimizer step
    assert fast["backward_passes"] < one["backward_passes"] and fast["per_step_equiv"] == 4  # its 4-step window
    assert res["setup"]["configs"]["fast recipe"] == "configs/sd35m_pickscore_fast.yaml"
    assert "| Flow-GRPO |" in W.markdown(res)


def test_the_cluster_size_setting_scales_a_ranks_rows_and_refuses_what_does_not_split():
    assert W.parse_settings({"gpus": "32"}) == {"gpus": 32}
    for bad in ({"gpus": "7"}, {"gpus": "256"}, {"rows": "4"}):
        with pytest.raises(SystemExit, match="whole_step"):
            W.parse_settings(bad)
