"""Start-up on the meta device (parallel.meta_init, parallel/meta_load.py): a run whose transformer is a skeleton and
whose shards each rank reads from the pipeline's files trains exactly as the run that loads the whole transformer on
every rank's host first: the same metrics and, bit for bit, the same trained weights. FSDP2 on 2 processes with a
LoRA (its lora_A drawn per name, models/lora.py lora_a_init), in one process a full fine-tune with its KL reference
copy (a second skeleton) and Wan2.2's two experts (each read from its own directory); the key refused by name where
it cannot act. What it saves in host memory: tools/bench/startup_memory.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from train_runs import dcp_entries, fit_metrics, launch

pytestmark = [pytest.mark.dist, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
SD3 = str(ROOT / "configs" / "sd3_tiny_cpu.yaml")
COMMON = ["parallel.engine=fsdp2", "train.steps=2", "run.checkpoint_every=0", "eval.enabled=false",
          "log.progress=false"]


def timeless(rows: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not k.startswith(("time_", "comm_"))} for r in rows]


def final_weights(out: Path, step: int = 2) -> dict[str, torch.Tensor]:
    return dcp_entries(out / "checkpoints" / f"step_{step:08d}", "model")


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_started_on_meta_train_a_lora_as_two_ranks_started_on_the_host(sd3_dir, tmp_path):
    args = [SD3, f"model.pretrained={sd3_dir}", *COMMON, "model.lora.enabled=true", "train.steps=1"]
    host, host_log = launch([*args, "parallel.meta_init=false"], 2, tmp_path / "host")
    meta, meta_log = launch([*args, "parallel.meta_init=true"], 2, tmp_path / "meta")
    assert meta_log.count("meta start-up:") == 2 and "meta start-up:" not in host_log  # each rank read its shards
    assert timeless(meta) == timeless(host) and len(meta) == 1  # one step: the start is what differs
    assert same(final_weights(tmp_path / "meta", 1), final_weights(tmp_path / "host", 1))


@pytest.mark.parametrize("kind, extra", [
    ("sd3", ["grpo.kl_beta=0.04"]),  # a full fine-tune and its KL reference: two skeletons, one file
    ("wan22", ["model.lora.enabled=true"]),  # two experts: each read from its directory, both adapters drawn
])
def test_one_rank_started_on_meta_trains_as_on_the_host(kind, extra, request, tmp_path, caplog):
    if kind == "sd3":
        config, pipe = SD3, request.getfixturevalue("sd3_dir")
    else:
        from jagg_scale.models.tiny import make_tiny_wan

        config, pipe = str(ROOT / "configs" / "wan22_tiny_cpu.yaml"), make_tiny_wan(tmp_path / "pipe", seed=0,
                                                                                      experts=True)
    args = [f"model.pretrained={pipe}", *COMMON, *extra]
    import logging

    caplog.set_level(logging.INFO, logger="jagg_scale.parallel.meta_load")
    host = fit_metrics(config, [*args, "parallel.meta_init=false"], tmp_path / "host")
    assert "meta start-up" not in caplog.text
    meta = fit_metrics(config, [*args, "parallel.meta_init=true"], tmp_path / "meta")
    read = [r.getMessage() for r in caplog.records if r.getMessage().startswith("meta start-up")]
    assert len(read) == (2 if "grpo.kl_beta=0.04" in extra else 1)  # the policy, and its KL reference
    assert timeless(meta) == timeless(host) and len(meta) == 2
    assert same(final_weights(tmp_path / "meta"), final_weights(tmp_path / "host"))


def test_meta_init_is_refused_where_it_cannot_act(sd3_dir, tmp_path):
    from jagg_scale.train import ConfigError, Trainer, load_config

    with pytest.raises(ConfigError, match=r"'parallel.meta_init' reads each rank's FSDP2 shards: it needs "
                                          r"parallel.engine fsdp2, not none"):
        load_config(SD3, [f"model.pretrained={sd3_dir}", "parallel.meta_init=true"])
    with pytest.raises(ConfigError, match=r"'parallel.meta_init' true: the meta start-up reads FSDP2 shards of a "
                                          r"diffusers pipeline's transformer"):
        Trainer(load_config(str(ROOT / "configs" / "tiny_cpu.yaml"),
                            ["parallel.engine=fsdp2", "parallel.meta_init=true", f"run.output_dir={tmp_path}"]))
