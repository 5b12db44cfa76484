"""Flow-DPPO in the trainer (train.algorithm dppo, train/dppo.py): the config's checks, JAGG's probe, micro-batches,
exact resume and LoRA; the engines on several processes are in tests/parallel/test_distributed.py."""

from pathlib import Path

import pytest

from jagg_scale.train import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"


@pytest.mark.parametrize("override,key,says", [
    (["train.algorithm=dppo", "grpo.clip_range=0.2"], "grpo.clip_range", "belongs to train.algorithm grpo; this run "
     "is dppo (Flow-DPPO does not clip"),
    (["dppo.kl_mask_threshold=1e-4"], "dppo.kl_mask_threshold", "belongs to train.algorithm dppo; this run is grpo"),
    (["train.algorithm=nft", "dppo.add_kl_coefficient=false"], "dppo.add_kl_coefficient", "belongs to train.algorithm "
     "dppo; this run is nft"),
    (["train.algorithm=dppo", "dppo.kl_mask_threshold=0"], "dppo.kl_mask_threshold", "must be > 0"),
    (["train.algorithm=dppo", "grpo.ref_at=knots"], "grpo.ref_at", "knots places the KL reference's forwards, but "
     "grpo.kl_beta is 0"),
])
def test_what_dppo_does_not_read_is_refused_naming_the_key(override, key, says):
    with pytest.raises(ConfigError, match=f"config key '{key}' {says}".replace("(", r"\(").replace(".", r"\.")):
        load_config(TINY, override)


def test_dppo_reads_grpos_sampler_and_reference_keys():
    """Its rollout, trained steps and KL reference are GRPO's: grpo.kl_beta builds the reference, the SDE window and
    the per-row selections are accepted, and the on-policy tolerance is read."""
    cfg = load_config(TINY, ["train.algorithm=dppo", "grpo.kl_beta=0.01", "grpo.ref_at=knots", "grpo.sde_window=4",
                             "grpo.onpolicy_tolerance=0.01", "dppo.kl_mask_threshold=1e-4"])
    assert cfg.uses_reference and not cfg.forward_process and cfg.algorithm_section is cfg.dppo
    assert load_config(TINY, ["train.algorithm=dppo", "grpo.step_selection=random"]).grpo.step_selection == "random"
