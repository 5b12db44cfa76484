"""What is checked every training step and stops the run in one line when it breaks (issue 34, fail closed).

    on-policy    on a step's first minibatch the parameters are the rollout's, so training must reproduce the
                 rollout's log-probabilities: max |log p(theta) - log p(old)| over every row and trained step of it
                 (metric onpolicy_log_ratio) above grpo.onpolicy_tolerance means the training forward is not the
                 rollout's (a kernel, dtype, compile or attention change between them) and every ratio of the step,
                 compared against a clip range of 1e-4, would be noise. The value is read with the step's other
                 metrics (no host sync of its own) and reduced with max over ranks, so every rank stops together.
"""

from __future__ import annotations

import math


class InvariantError(RuntimeError):
    """A per-step invariant broke: the run stops (jagg-train exits 1 with this one line)."""


def check_on_policy(metrics: dict, tolerance: float, step: int) -> None:
    value = metrics.get("onpolicy_log_ratio")
    # None: no GRPO minibatch (DiffusionNFT has no log-ratio); non-finite: the optimizer step skips it (engine)
    if value is None or not math.isfinite(value) or value <= tolerance:
        return
    raise InvariantError(
        f"training step {step}: the first minibatch's max |log ratio| to the rollout is {value:.3g} at the rollout's "
        f"own parameters, above grpo.onpolicy_tolerance={tolerance:g}: the training forward no longer reproduces "
        "the rollout's (model.dtype, model.attention, a kernel or compile change?); stopping before it trains on it")
