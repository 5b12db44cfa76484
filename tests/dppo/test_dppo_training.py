"""Flow-DPPO in the trainer (train.algorithm dppo, train/dppo.py): the config's checks, JAGG's probe, micro-batches,
exact resume and LoRA (micro-batches on their own: tests/dppo/test_dppo_loss.py); the engines on several processes:
tests/parallel/test_distributed.py."""

from pathlib import Path

import pytest

from jagg_scale.train import ConfigError, load_config
from train_runs import fit_metrics, small_dit

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


@pytest.mark.parametrize("override,key,says", [
    (["train.algorithm=dppo", "grpo.clip_range=0.2"], "grpo.clip_range", "belongs to train.algorithm grpo.*; this "
     "run is dppo (Flow-DPPO does not clip"),
    (["dppo.kl_mask_threshold=1e-4"], "dppo.kl_mask_threshold", "belongs to train.algorithm dppo; this run is grpo"),
    (["train.algorithm=nft", "dppo.add_kl_coefficient=false"], "dppo.add_kl_coefficient", "belongs to train.algorithm "
     "dppo; this run is nft"),
    (["train.algorithm=dppo", "dppo.kl_mask_threshold=0"], "dppo.kl_mask_threshold", "must be > 0"),
    (["train.algorithm=dppo", "grpo.ref_at=knots"], "grpo.ref_at", "knots places the KL reference's forwards, but "
     "grpo.kl_beta is 0"),
])
def test_what_dppo_does_not_read_is_refused_naming_the_key(override, key, says):
    with pytest.raises(ConfigError, match=f"config key '{key}' {says}".replace("(", r"\(").replace(".", r"\.")
                       .replace(r"\.*", ".*")):
        load_config(TINY, override)


def test_dppo_reads_grpos_sampler_and_reference_keys():
    """Its rollout, trained steps and KL reference are GRPO's: grpo.kl_beta builds the reference, the SDE window and
    the per-row selections are accepted, and the on-policy tolerance is read."""
    cfg = load_config(TINY, ["train.algorithm=dppo", "grpo.kl_beta=0.01", "grpo.ref_at=knots", "grpo.sde_window=4",
                             "grpo.onpolicy_tolerance=0.01", "dppo.kl_mask_threshold=1e-4"])
    assert cfg.uses_reference and not cfg.forward_process and cfg.algorithm_section is cfg.dppo
    assert load_config(TINY, ["train.algorithm=dppo", "grpo.step_selection=random"]).grpo.step_selection == "random"


@pytest.mark.slow
def test_dppo_trains_with_an_exact_probe_and_resumes_exactly(tmp_path):
    """Two optimizer steps per rollout (the second off the rollout's weights: the KL and the mask act), the KL
    reference at the knots, JAGG windows of 2 (exact: the probe's cosine is 1) and micro-batches of 2; a run cut after
    step 0 and resumed writes the uninterrupted run's metrics."""
    common = small_dit(4, 3) + ["train.algorithm=dppo", "grpo.kl_beta=0.01", "grpo.ref_at=knots", "jagg.window=2",
                                "jagg.probe_every=1", "train.micro_batch_size=2", "train.lr=3e-3",
                                "run.checkpoint_every=1", "dppo.kl_mask_threshold=1e-6"]
    full = fit_metrics(TINY, common + ["train.steps=2"], tmp_path / "full")
    fit_metrics(TINY, common + ["train.steps=1"], tmp_path / "cut")
    resumed = fit_metrics(TINY, common + ["train.steps=2", "run.resume=auto"], tmp_path / "cut")
    assert resumed == full
    for r in full:
        assert r["probe_cos"] == pytest.approx(1.0, abs=1e-6) and r["optimizer_steps"] == 2
        assert r["onpolicy_log_ratio"] < 1e-5 and r["kl"] > 0
    assert max(r["kl_new_old_max"] for r in full) > 1e-6 and max(r["masked_fraction"] for r in full) > 0


@pytest.mark.slow
def test_dppo_with_lora_and_cfg_under_fsdp2_resumes_exactly(sd3_dir, tmp_path):
    """The SD3 pipeline with a LoRA adapter, CFG 4.5 and two optimizer steps per rollout (the second refreshes the
    unconditional predictions; the old means keep the rollout's), on the fsdp2 engine: a resumed run is the
    uninterrupted one bit for bit."""
    common = [f"model.pretrained={sd3_dir}", "model.lora.enabled=true", "model.lora.rank=4", "model.lora.alpha=8",
              "parallel.engine=fsdp2", "train.algorithm=dppo", "sampling.num_steps=4",
              "train.minibatch_size=4", "run.checkpoint_every=1", "eval.enabled=false"]
    sd3 = ROOT / "configs" / "sd3_tiny_cpu.yaml"
    whole = fit_metrics(sd3, common + ["train.steps=2"], tmp_path / "whole")
    fit_metrics(sd3, common + ["train.steps=1"], tmp_path / "split")
    assert fit_metrics(sd3, common + ["train.steps=2", "run.resume=auto"], tmp_path / "split") == whole
    assert all(r["uncond_forward_passes"] > 0 and r["optimizer_steps"] == 2 for r in whole)
