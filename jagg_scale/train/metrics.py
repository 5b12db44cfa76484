"""A step's metrics on the device, and their one read to the host.

    reduce_metrics(recorded)   {name: [values]} -> {name: 0-d tensor}: means, except ratio_max / ratio_min, which
                               keep their extremes; computed where the values live (no host synchronisation)
    fetch_metrics(metrics)     every tensor value of a step's metrics to a Python float by ONE device-to-host copy
                               (a training step's only read of its loss statistics)

The loss (grpo/loss.py) records its per-evaluation statistics as detached tensors; the Updater reduces them per
minibatch and over the step, and the Trainer fetches the step's row once, when it logs.
"""

from __future__ import annotations

import torch

__all__ = ["fetch_metrics", "reduce_metrics"]

_EXTREMES = {"ratio_max": torch.amax, "ratio_min": torch.amin}


def reduce_metrics(recorded: dict[str, list]) -> dict[str, torch.Tensor]:
    out = {}
    for k, vals in recorded.items():
        if vals:
            stacked = torch.stack([torch.as_tensor(v).detach().float().reshape(()) for v in vals])
            out[k] = _EXTREMES.get(k, torch.mean)(stacked)
    return out


def fetch_metrics(metrics: dict) -> dict:
    keys = [k for k, v in metrics.items() if torch.is_tensor(v)]
    if not keys:
        return dict(metrics)
    device = metrics[keys[0]].device
    values = torch.stack([metrics[k].detach().float().reshape(()).to(device) for k in keys]).tolist()
    return {**metrics, **dict(zip(keys, values))}
