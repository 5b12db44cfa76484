"""The reward server's batching: concurrent requests for one reward scored as one batch (`jagg-reward-server
--batch-rows`, `--batch-wait-ms`).

A request's worker thread queues its request (parsed, pixel limits checked, nothing decoded) and takes a decode slot;
holding one, it leads a batch unless another leader has taken its request meanwhile: it takes every queued request of
the same shape (image size, frames, edit or not), oldest first, while the batch stays within `batch_rows` rows and the
server's per-request pixel budget, decodes them into one tensor, scores it under the reward's lock and hands each
request its rows' scores. So memory is what it was (at most decode_slots batches decoded, each within one request's
pixel budget), a lone client waits for nothing (`batch_wait_ms` 0: a batch is what queued while the reward was busy),
and under load the reward sees few large batches instead of many small ones, one request at a time. A reward's `info`
is split the way the remote client merges it: a list of one entry per row is sliced, anything else is the batch's.

Per reward: one batch scored at a time (its lock), decoding of the next pipelined beside it; rewards on different
devices (their `device` option) score concurrently."""

from __future__ import annotations

import logging
import threading
from collections import deque
import time
from dataclasses import dataclass, field

import torch

from . import server_limits as lim
from .base import RewardOutput

log = logging.getLogger(__name__)

__all__ = ["Batcher"]


@dataclass(eq=False)
class _Item:
    req: lim.Request
    rows: int
    pixels: int
    key: tuple
    taken: bool = False
    done: threading.Event = field(default_factory=threading.Event)
    result: tuple[int, bytes] = (500, b'{"error": "not scored"}')


class Batcher:
    """One reward's queue (module docstring). score() runs in a server worker thread and returns (status, body)."""

    def __init__(self, name: str, reward, slots: lim.Slots, *, batch_rows: int, max_pixels: int,
                 wait_s: float = 0.0):
        self.name, self.reward, self.slots = name, reward, slots
        self.batch_rows, self.max_pixels, self.wait_s = batch_rows, max_pixels, wait_s
        self.lock = threading.Lock()  # one batch scored at a time
        self.cond = threading.Condition()
        self.queue: list[_Item] = []
        self.batches: deque[int] = deque(maxlen=1024)  # rows of the last batches scored (tests and monitoring)

    def score(self, req: lim.Request) -> tuple[int, bytes]:
        w, h = req.pngs[0].size
        item = _Item(req, len(req.prompts), req.pixels,
                     (w, h, req.frames, hasattr(req, "_inputs")))
        with self.cond:
            self.queue.append(item)
            self.cond.notify_all()  # a leader waiting batch_wait_ms for more
        with self.slots.take():  # the memory bound: decode_slots batches decoded at once
            with self.cond:
                batch = []
                if not item.taken:  # else led by another thread while this one waited for the slot
                    self._fill()
                    batch = self._take(item)
            if batch:
                self._run(batch)  # every member done, whatever happens
        item.done.wait()
        return item.result

    def _fill(self) -> None:
        """Wait up to wait_s (cond held) for the queue to fill a batch."""
        deadline = time.monotonic() + self.wait_s
        while sum(i.rows for i in self.queue) < self.batch_rows and (left := deadline - time.monotonic()) > 0:
            self.cond.wait(left)

    def _take(self, own: _Item) -> list[_Item]:
        """The oldest queued requests of `own`'s shape within the batch's rows and pixels (`own` always: alone it is
        within the request limits), removed from the queue."""
        batch, rows, pixels = [own], own.rows, own.pixels
        for other in self.queue:
            if other is not own and other.key == own.key and rows + other.rows <= self.batch_rows \
                    and pixels + other.pixels <= self.max_pixels:
                batch.append(other)
                rows, pixels = rows + other.rows, pixels + other.pixels
        taken = set(map(id, batch))
        self.queue = [i for i in self.queue if id(i) not in taken]
        for i in batch:
            i.taken = True
        return batch

    def _run(self, batch: list[_Item]) -> None:
        """Decode the batch (a request whose pixels fail: 400 for it alone), score it, split it; every member done."""
        try:
            first = batch[0].req
            w, h = first.pngs[0].size
            shape = (3, first.frames, h, w) if first.frames else (3, h, w)
            images = torch.empty(sum(i.rows for i in batch), *shape)  # each request decoded into its rows
            at, good = 0, []
            for item in batch:
                try:
                    item.req.decode(out=images[at: at + item.rows])
                    good += range(at, at + item.rows)
                except ValueError as e:  # its pixels did not decode: that request alone is refused
                    self._settle(item, 400, {"error": str(e)})
                at += item.rows
            members = [item for item in batch if not item.done.is_set()]
            if not members:
                return
            if len(good) < len(images):
                images = images[good]
            prompts = [p for item in members for p in item.req.prompts]
            metadata = [m for item in members for m in item.req.metadata]
            try:
                try:
                    with self.lock:
                        out = self.reward(images, prompts, metadata)
                except ValueError as e:  # the reward refused what it was given: the same request fails again
                    log.warning("reward %r refused a batch of %d: %s", self.name, len(prompts), e)
                    for item in members:
                        self._settle(item, 422, {"error": f"reward {self.name!r} cannot take this request: {e}"})
                    return
                del images
                scores, info = (out.scores, out.info) if isinstance(out, RewardOutput) else (out, {})
                scores = torch.as_tensor(scores).detach().float().cpu().reshape(-1)
                if scores.numel() != len(prompts):
                    raise RuntimeError(f"reward returned {scores.numel()} scores for a batch of {len(prompts)}")
                self.batches.append(len(prompts))
            except Exception as e:
                log.exception("reward %r raised on a batch of %d", self.name, len(prompts))
                for item in members:
                    self._settle(item, 500, {"error": f"reward {self.name!r} raised {type(e).__name__}: {e}"})
                return
            at, n = 0, len(prompts)
            for item in members:
                part = {k: v[at: at + item.rows] if isinstance(v, list) and len(v) == n else v
                        for k, v in (info or {}).items()}
                self._settle(item, 200, {"scores": lim.to_jsonable(scores[at: at + item.rows].tolist()),
                                         "info": lim.to_jsonable(part)})
                at += item.rows
        finally:
            for item in batch:  # whatever went wrong, no request waits forever
                if not item.done.is_set():
                    self._settle(item, 500, {"error": f"reward {self.name!r}: the batch was not scored"})

    @staticmethod
    def _settle(item: _Item, status: int, payload: dict) -> None:
        try:
            item.result = (status, lim.dump_json(payload))
        except ValueError as e:  # a NaN or infinity in the reward's info
            item.result = (500, lim.dump_json({"error": f"reply not JSON-serializable: {e}"}))
        item.done.set()
