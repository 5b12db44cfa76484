"""When the EMA of the trainable weights (train.ema_decay > 0) moves, and by how much: `ema_decay_at`.

Every engine keeps the EMA as its shadow weight set "ema" (engine.py) and, after each applied optimizer step, moves
it by the decay this returns (None: no update due). The rule is Flow-GRPO's EMAModuleWrapper (yifan123/flow_grpo
ac4c86e, flow_grpo/ema.py:33-49), which DiffusionNFT uses unchanged (NVlabs/DiffusionNFT 24af555,
flow_grpo/ema.py:25-38):

    after optimizer step s, when (s + 1) % ema_every == 0:
        d = min((1 + s) / (10 + s), ema_decay)   with ema_warmup (ema_decay alone without)
        ema = d^ema_repeat * ema + (1 - d^ema_repeat) * weights

s is counted as the peers count it when they call the wrapper: their `global_step` after the step's increment, so
1 after the first optimizer step (Flow-GRPO scripts/train_sd3.py:952-955, DiffusionNFT scripts/train_nft_sd3.py:
1021-1029); hence the first update of an interval of 8 comes after optimizer step 7, with d = 8 / 17. The defaults
(every 1, no warm-up, repeat 1) are a constant decay after every optimizer step.

ema_repeat: Flow-GRPO calls its EMA step once per training batch, not once per optimizer step (train_sd3.py:954-955
sit in the loop over batches, outside its `if accelerator.sync_gradients` branch): gradient_accumulation_steps
times with the same s, towards the same weights (the accumulation's other batches do not step the optimizer). That
is 2 in its 32-GPU SD3.5 recipes (config/grpo.py:118-125 for pickscore_sd3, as geneval_sd3 and general_ocr_sd3: 4
batches of 9 per GPU per epoch, train_sd3.py:833-836, accumulated 2 by 2), so each of its updates moves the EMA by
d twice. n moves by d towards the same weights are one move by d^n, taken here in one
pass. DiffusionNFT calls it once per optimizer step (train_nft_sd3.py:1024-1029: gated on the accumulation
boundary): repeat 1.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["EMASettings", "ema_decay_at"]


class EMASettings(Protocol):
    """The EMA's settings an engine reads (the run config's `train` section has them)."""

    ema_decay: float  # > 0: an EMA of the trainable weights is kept
    ema_every: int  # optimizer steps between updates
    ema_warmup: bool  # Flow-GRPO's warm-up of the decay
    ema_repeat: int  # moves per update (Flow-GRPO: one per accumulated batch)


def ema_decay_at(optimizer_steps: int, ema: EMASettings) -> float | None:
    """The decay of the EMA update after optimizer step `optimizer_steps` (counted from 1), or None when none is due."""
    s = optimizer_steps
    if (s + 1) % ema.ema_every:
        return None
    decay = min((1 + s) / (10 + s), ema.ema_decay) if ema.ema_warmup else ema.ema_decay
    return decay ** ema.ema_repeat
