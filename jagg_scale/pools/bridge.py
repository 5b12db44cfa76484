"""The channel between the pools: point-to-point messages of named tensors over a process group of the whole launch.

Each pool has its own default process group (its collectives, FSDP2 meshes and checkpoints are a plain run's of its
size, pools/world.py); the bridge is one more group over every rank of the launch, made directly on the launch's
store (gloo on CPU, NCCL on GPUs), used only for sends and receives between the pools:

    message = [magic, header bytes, payload bytes] (int64 x 3) + header (JSON: meta, tensor names, dtypes, shapes)
              + payload (the tensors' bytes, concatenated)

A receiver checks the sizes against its bounds before it allocates anything (a header of at most 1 MiB, a payload of
at most pools.max_message_gib), the header's tensors against the payload's size, and waits at most pools.timeout_s:
a peer that died (its connection closed) or hung (nothing within the timeout) stops this rank with one line naming
the peer's rank and what was awaited (PoolError). Messages of one kind between two ranks arrive in the order sent
(one tag per kind)."""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta

import torch

__all__ = ["Bridge", "PoolError", "digest", "TAGS"]

MAGIC = 0x4A414747  # "JAGG"
HEADER_LIMIT = 1 << 20
TAGS = {"start": 1, "weights": 2, "rollout": 3}
DTYPES = {str(d).removeprefix("torch."): d for d in (torch.float32, torch.float64, torch.float16, torch.bfloat16,
                                                     torch.int64, torch.int32, torch.uint8, torch.bool)}


class PoolError(RuntimeError):
    """The other pool failed, hung, or sent what this one cannot accept; the message is one line naming the rank."""


def digest(t: torch.Tensor) -> str:
    """A tensor's content digest: its dtype, shape and bytes (blake2b), read on the host."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{t.dtype}|{tuple(t.shape)}|".encode())
    h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


class Bridge:
    """Sends and receives between the pools. `group`: a process group over every rank of the launch (global ranks);
    `device`: where its buffers live (a CUDA device under NCCL, the host under gloo)."""

    def __init__(self, group, rank: int, world_size: int, *, device: torch.device, timeout_s: float,
                 limit_bytes: int):
        self.group, self.rank, self.world_size = group, rank, world_size
        self.device, self.timeout_s, self.limit_bytes = device, timeout_s, limit_bytes
        self._pending: dict[tuple, list] = {}  # (dst, kind) -> the works (and buffers) of the last such message

    # ------------------------------------------------------------------ sending
    def send(self, dst: int | list[int], kind: str, meta: dict, tensors: dict[str, torch.Tensor | None] | None = None
             ) -> None:
        """Start sending one message to `dst` (a rank, or several: packed once, the same buffers sent to each);
        asynchronous: the previous message of this kind to each is waited for first, so at most one of a kind is in
        flight per peer, its buffers alive until sent."""
        dsts = [dst] if isinstance(dst, int) else list(dst)
        for d in dsts:
            self.flush(d, kind)
        tensors = {k: v for k, v in (tensors or {}).items() if v is not None}
        spec = [[name, str(t.dtype).removeprefix("torch."), list(t.shape)] for name, t in tensors.items()]
        for name, dtype, _ in spec:
            if dtype not in DTYPES:
                raise PoolError(f"pools: tensor {name!r} of dtype {dtype} cannot be sent between the pools")
        header = torch.frombuffer(bytearray(json.dumps({"meta": meta, "tensors": spec}).encode()), dtype=torch.uint8)
        flat = []
        for t in tensors.values():  # each tensor's bytes padded to ALIGN: the receiver views them in place
            b = t.detach().reshape(-1).contiguous().view(torch.uint8).to(self.device)
            flat += [b, torch.zeros(_padded(b.numel()) - b.numel(), dtype=torch.uint8, device=self.device)]
        payload = torch.cat(flat) if flat else torch.empty(0, dtype=torch.uint8, device=self.device)
        sizes = torch.tensor([MAGIC, header.numel(), payload.numel()], dtype=torch.int64, device=self.device)
        tag = TAGS[kind]
        parts = [sizes, header.to(self.device)] + ([payload] if payload.numel() else [])
        for dst in dsts:
            try:
                self._pending[dst, kind] = [(self.group.send([p], dst, tag), p) for p in parts]
            except RuntimeError as err:
                raise PoolError(f"pools: rank {self.rank} could not send the {kind} message to rank {dst}: "
                                f"{_first_line(err)}") from err

    def flush(self, dst: int | None = None, kind: str | None = None) -> None:
        """Wait until the messages in flight (to `dst` of `kind`, or to every peer) are sent."""
        for key in [(dst, kind)] if dst is not None else list(self._pending):
            for work, _ in self._pending.pop(key, []):
                self._wait(work, key[0], f"sending the {key[1]} message to")

    # ------------------------------------------------------------------ receiving
    def recv(self, src: int, kind: str, timeout_s: float | None = None) -> tuple[dict, dict[str, torch.Tensor]]:
        """One message of `kind` from `src`: (meta, {name: tensor on self.device}); PoolError naming `src` when it
        died, hung past the timeout (`timeout_s` for its first part, where a wait is longer than pools.timeout_s:
        the start waits for the other pool's set-up, a rollout rank's weights for the trainers' step), or sent more
        than the bounds allow."""
        tag, what = TAGS[kind], f"the {kind} message from"
        sizes = torch.empty(3, dtype=torch.int64, device=self.device)
        self._wait(self.group.recv([sizes], src, tag), src, f"waiting for {what}", timeout_s)
        magic, header_len, payload_len = sizes.tolist()
        if magic != MAGIC or not 0 < header_len <= HEADER_LIMIT or not 0 <= payload_len <= self.limit_bytes:
            raise PoolError(f"pools: {what} rank {src} announces a header of {header_len} bytes and a payload of "
                            f"{payload_len} (limits {HEADER_LIMIT} and {self.limit_bytes}: pools.max_message_gib), "
                            f"magic {magic:#x}: refused before allocating it")
        header = torch.empty(header_len, dtype=torch.uint8, device=self.device)
        self._wait(self.group.recv([header], src, tag), src, f"waiting for {what}")
        try:
            parsed = json.loads(bytes(header.cpu().numpy()))
            meta, spec = parsed["meta"], parsed["tensors"]
            sizes_ = [_nbytes(dtype, shape) for _, dtype, shape in spec]
            if len(spec) > 4096 or len({name for name, _, _ in spec}) != len(spec):
                raise ValueError(f"{len(spec)} tensors, names not distinct or too many")
        except (ValueError, KeyError, TypeError) as err:
            raise PoolError(f"pools: {what} rank {src} has an unreadable header: {_first_line(err)}") from err
        if sum(map(_padded, sizes_)) != payload_len:
            raise PoolError(f"pools: {what} rank {src} describes {sum(map(_padded, sizes_))} bytes of tensors in a "
                            f"payload of {payload_len}")
        payload = torch.empty(payload_len, dtype=torch.uint8, device=self.device)
        if payload_len:
            self._wait(self.group.recv([payload], src, tag), src, f"waiting for {what}")
        out, at = {}, 0
        for (name, dtype, shape), n in zip(spec, sizes_):
            out[name] = payload[at: at + n].view(DTYPES[dtype]).reshape(shape)
            at += _padded(n)
        return meta, out

    def _wait(self, work, peer: int, doing: str, timeout_s: float | None = None) -> None:
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            work.wait(timedelta(seconds=timeout_s))
        except RuntimeError as err:
            text = _first_line(err)
            cause = (f"nothing within {timeout_s:g} s: rank {peer} is hung or stopped"
                     if "timeout" in text.lower() or "timed out" in text.lower() else
                     f"rank {peer} is gone ({text})")
            raise PoolError(f"pools: rank {self.rank} {doing} rank {peer}: {cause}; stopping the job") from err


ALIGN = 16


def _padded(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


def _nbytes(dtype: str, shape) -> int:
    if dtype not in DTYPES or not isinstance(shape, list) or len(shape) > 8:
        raise ValueError(f"tensor of dtype {dtype!r}, shape {shape!r}")
    n = 1
    for d in shape:
        if not isinstance(d, int) or d < 0:
            raise ValueError(f"shape {shape!r}")
        n *= d
    return n * torch.empty(0, dtype=DTYPES[dtype]).element_size()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:300] if text else type(err).__name__
