"""Two ends of a real bridge in one process: a gloo group of 2 over an in-memory store, each end in its own thread
(the bridge's sends, receives, bounds and timeouts, without a launch)."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import torch
import torch.distributed as dist

from jagg_scale.pools.bridge import Bridge


def pair(timeout_s: float = 600.0, limit_bytes: int = 1 << 30) -> tuple[Bridge, Bridge]:
    """Bridges of ranks 0 and 1 of one 2-rank gloo group; the timeout a hang guard unless a test sets its own."""
    store = dist.HashStore()
    barrier = threading.Barrier(2)

    def make(rank: int) -> Bridge:
        barrier.wait()
        group = dist.ProcessGroupGloo(dist.PrefixStore("bridge", store), rank, 2, timedelta(seconds=timeout_s))
        return Bridge(group, rank, 2, device=torch.device("cpu"), timeout_s=timeout_s, limit_bytes=limit_bytes)

    with ThreadPoolExecutor(2) as ex:
        a, b = ex.map(make, (0, 1))
    return a, b


def both(f0, f1):
    """f0() and f1() at once (one per end); their results, an exception re-raised."""
    with ThreadPoolExecutor(2) as ex:
        x, y = ex.submit(f0), ex.submit(f1)
        return x.result(timeout=120), y.result(timeout=120)
