"""Host synchronisations in the training loop (issue 15 item 2): the counter, and a training step of the
sd35m_pickscore per-rank layout on the CPU that reads device values back at most 25 times.

The layout is sd35m_pickscore's share of one rank of 8 GPUs: 6 prompts x 24 images = 144 rows sampled in chunks of 9
over 10 SDE steps with CFG 4.5, 9 trained steps in JAGG windows of 4 (jagg_frac 1, vcos routing), two minibatches
of 72 rows (two optimizer steps) in micro-batches of 72, KL beta 0.01 to the adapter-off LoRA base, bf16 autocast.
The model is the tiny SD3 pipeline: what is counted is the loop, not the model's size.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from jagg_scale.estimate.layout import rank_share
from jagg_scale.train import Trainer, load_config
from jagg_scale.train.host_syncs import HostSyncs

ROOT = Path(__file__).resolve().parents[2]

PRODUCTION = ROOT / "configs" / "sd35m_pickscore.yaml"
TINY_RUN = ["model.lora.rank=4", "model.lora.alpha=8", "train.steps=2", "run.checkpoint_every=0", "log.progress=false",
            "run.resume=none", "run.device=cpu"]


def layout() -> list[str]:
    """sd35m_pickscore's share of one rank of 8 (estimate/layout.py), on the tiny pipeline's small LoRA."""
    return [*rank_share(load_config(PRODUCTION, check_files=False), 8), *TINY_RUN]
MAX_SYNCS = 25


def test_the_counter_counts_reads_and_data_copies_in_its_own_thread_only():
    t = torch.randn(4)
    with HostSyncs() as syncs:
        t.sum().item()
        float(t[0])
        bool(t[1] > 0)
        t.tolist()
        torch.tensor([1.0, 2.0], device="cpu")  # Python data to a named device: a blocking copy on a GPU
        t * 2 + 1  # device work: nothing to count
        torch.zeros(3, device="cpu")  # a fill on the device: nothing to count
        worker = threading.Thread(target=lambda: [float(t[0]) for _ in range(5)])  # another thread: not counted
        worker.start()
        worker.join()
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))])
        opt.param_groups[0]["params"][0].grad = torch.ones(3)
        opt.step()  # torch's own host-side step counter reads: not counted
    assert dict(syncs.by_call) == {"item": 1, "__float__": 1, "__bool__": 1, "tolist": 1, "tensor(device=)": 1}
    assert syncs.count == 5


@pytest.mark.slow
def test_a_training_step_of_the_sd35m_layout_reads_the_device_at_most_25_times(sd3_dir, tmp_path):
    cfg = load_config(ROOT / "configs" / "sd3_tiny_cpu.yaml",
                      [f"model.pretrained={sd3_dir}", f"run.output_dir={tmp_path}", *layout()])
    trainer = Trainer(cfg)
    try:
        trainer.train_step(0)  # warm-up: lazy initialisation (the empty prompt's embedding, optimizer state)
        with HostSyncs(sites=True) as syncs:
            metrics = trainer.train_step(1)
    finally:
        trainer.close()
    assert metrics["optimizer_steps"] == 2 and metrics["windows"] == 6  # 2 minibatches x windows [0-3] [4-7] [8]
    assert isinstance(metrics["loss"], float) and isinstance(metrics["grad_norm"], float)  # read once, as floats
    where = "\n".join(f"{n:4d} {site}" for site, n in syncs.by_site.most_common())
    assert syncs.count <= MAX_SYNCS, f"{syncs.count} host syncs in one training step:\n{where}"
    # nothing per SDE step, per chunk or per window: 16 chunks x 10 steps would show as multiples of 16 or 160
    assert max(syncs.by_site.values()) <= 4, where


def test_flux_rope_ids_are_built_once_per_size(flux_dir):
    from jagg_scale.models.flux import FluxVelocity

    model = FluxVelocity.from_pretrained(flux_dir)
    calls = []
    build = model.pipe._prepare_latent_image_ids
    model.pipe._prepare_latent_image_ids = lambda *a: calls.append(a) or build(*a)
    x = torch.randn(2, *model.latent_shape)
    cond = model.encode_prompts(["a", "b"])
    with torch.no_grad():
        first = model(x, torch.full((2,), 0.5), cond)
        again = model(x, torch.full((2,), 0.5), cond)
    assert len(calls) == 1 and torch.equal(first, again)
