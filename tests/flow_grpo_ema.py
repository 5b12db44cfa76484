"""Flow-GRPO's EMA, transcribed in float64 from its code (yifan123/flow_grpo ac4c86e), independently of
jagg_scale/parallel/ema.py: what the engines' EMA must equal (tests/train/test_ema.py, and on 2 FSDP2 processes
tests/dist_workers/checkpoint_worker.py).

    flow_grpo/ema.py:33-56        EMAModuleWrapper.get_current_decay and .step
    scripts/train_sd3.py:846-955  the loop over training batches that calls it: once per batch, after the batch's
                                  backward and, at the accumulation boundary, the optimizer step and
                                  `global_step += 1`
"""

from __future__ import annotations

import torch


class EMAModuleWrapper:
    """flow_grpo/ema.py's wrapper over named float64 copies; `warmup` False gives the constant decay instead of
    get_current_decay's min((1 + s) / (10 + s), decay) (not Flow-GRPO's: this stack's ema_warmup false)."""

    def __init__(self, parameters: dict[str, torch.Tensor], decay: float, update_step_interval: int, warmup: bool):
        self.ema_parameters = {n: p.detach().double().clone() for n, p in parameters.items()}
        self.decay, self.update_step_interval, self.warmup = decay, update_step_interval, warmup

    def get_current_decay(self, optimization_step: int) -> float:
        if not self.warmup:
            return self.decay
        return min((1 + optimization_step) / (10 + optimization_step), self.decay)

    def step(self, parameters: dict[str, torch.Tensor], optimization_step: int) -> None:
        one_minus_decay = 1 - self.get_current_decay(optimization_step)
        if (optimization_step + 1) % self.update_step_interval == 0:
            for n, ema_parameter in self.ema_parameters.items():
                ema_parameter.add_(one_minus_decay * (parameters[n].double() - ema_parameter))


def flow_grpo_ema(weights: list[dict[str, torch.Tensor]], decay: float, interval: int, warmup: bool,
                  accumulation: int = 1) -> dict[str, torch.Tensor]:
    """The EMA after Flow-GRPO's batch loop trained `weights[1:]` (weights[s]: the trained weights after optimizer
    step s, weights[0] the initial ones) with `accumulation` batches per optimizer step (its
    gradient_accumulation_steps), run up to the last batch before the next optimizer step: every call of the
    wrapper with global_step s made (a later step's first batches still see step s's weights and count)."""
    ema = EMAModuleWrapper(weights[0], decay, interval, warmup)
    global_step = 0
    for i in range(len(weights) * accumulation - 1):  # batch i
        if (i + 1) % accumulation == 0:  # accelerator.sync_gradients: this batch's optimizer step is taken
            global_step += 1
        ema.step(weights[global_step], global_step)
    return ema.ema_parameters
