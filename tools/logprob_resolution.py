"""How far a 16-bit forward moves a transition's log-probability, per model.dtype (issue 34's fp16 against bf16).

    python tools/logprob_resolution.py CONFIG [overrides ...]   # e.g. configs/sd3_tiny_cpu.yaml model.pretrained=DIR

For float32, bfloat16 and float16 in turn: the trainer's step-0 rollout of CONFIG under that dtype, then every SDE
transition's velocity recomputed from the same weights in float32 (the model upcast, no autocast), one row a
forward, and its log-probability re-scored (grpo/sde.py). Prints max and mean |log p(rollout) - log p(float32)|:
the resolution at which the dtype's forward places a log-probability, beside the clip range GRPO compares
exp(difference) against. Rollout and training share the dtype, so the first minibatch of a step sees none of it
(it reuses the rollout's values); a recomputation after an optimizer step carries noise of this order.
CPU autocast numerics (fp32 accumulation): indicative of the dtypes' ordering, not of a GPU's magnitudes.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from jagg_scale.cond import index_cond, map_cond  # noqa: E402
from jagg_scale.grpo.sde import sde_step_with_logprob  # noqa: E402
from jagg_scale.train import Trainer, load_config  # noqa: E402
from jagg_scale.train.rows import StepRows  # noqa: E402


@torch.no_grad()
def resolution(config: str, overrides: list[str], dtype: str) -> tuple[float, float, float]:
    """(max, mean |delta log p|, clip range) of `dtype` on the step-0 rollout of `config`."""
    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(config, [*overrides, f"model.dtype={dtype}", "log.progress=false",
                                   "run.checkpoint_every=0", f"run.output_dir={out}"])
        trainer = Trainer(cfg)
        try:
            g = cfg.grpo.group_size
            records = [r for r in trainer.source.next_prompts() for _ in range(g)]
            rows = StepRows.draw(len(records), cfg.train.minibatch_size, cfg.run.seed, 0, 0, 1, 1).mine
            cond = trainer.policy.encode([records[i].prompt for i in rows.tolist()])
            trainer.model.eval()
            traj = trainer.policy.rollout(cond, rows, 0)
            trainer.model.float()  # the same weights in float32 (the frozen parts too: cond is already encoded)
            cfg.model.dtype = "float32"  # the policy's autocast off
            velocity, s = trainer.policy.velocity_fn(), traj.sigmas
            cond = map_cond(lambda t: t.float() if t.is_floating_point() else t, cond)
            deltas = []
            for k in range(len(s) - 1):
                if s[k + 1] == 0:  # the last step (to s = 0) has no noise, hence no density
                    continue
                for i in range(len(rows)):
                    v = velocity(traj.latents[k, i:i + 1], s[k].expand(1), index_cond(cond, slice(i, i + 1)))
                    lp = sde_step_with_logprob(traj.latents[k, i:i + 1], v, s[k], s[k + 1],
                                               noise_level=cfg.sampling.noise_level, sigma_max=s[1],
                                               prev_sample=traj.latents[k + 1, i:i + 1]).log_prob
                    deltas.append((lp - traj.log_probs[k, i]).abs())
            d = torch.cat(deltas).double()
            return float(d.max()), float(d.mean()), cfg.grpo.clip_range
        finally:
            trainer.close()


def main(argv: list[str]) -> None:
    config, overrides = argv[0], argv[1:]
    print(f"{config} {' '.join(overrides)}")
    print("| model.dtype | max abs delta log p | mean abs delta log p | grpo.clip_range |\n|---|---|---|---|")
    for dtype in ("float32", "bfloat16", "float16"):
        worst, mean, clip = resolution(config, overrides, dtype)
        print(f"| {dtype} | {worst:.3g} | {mean:.3g} | {clip:g} |")


if __name__ == "__main__":
    main(sys.argv[1:])
