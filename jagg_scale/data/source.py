"""Where a training step's prompts come from: the same list of `prompts_per_step` records on every rank.

GRPO's groups are global (a group's samples may be spread over ranks, its advantages need all of its rewards), so
every rank must agree on the step's prompts. Two sources:

    ListPromptSource    a prompt file / inline list held in memory, visited epoch by epoch (PromptSampler). Every
                        rank runs the same seeded sampler, so no communication is needed.
    StreamPromptSource  webdataset shards (data.source: wds). Each rank streams its own disjoint shard subset
                        (ShardPromptStream: split by rank and worker, seeded resampling) and draws
                        prompts_per_step / world records; one all-gather assembles the step's list in rank order.

`state_dict()` is what the checkpoint stores to continue the same sequence; for streams it holds every rank's
position (gathered), and a resumed run picks its own.

PromptSampler, the list source's deterministic, resumable order: which prompts_per_step prompts a step uses (the
trainer repeats each drawn prompt group_size times, contiguously: group k is rows k*G:(k+1)*G). Prompts are visited
epoch by epoch in a permutation seeded by `seed + epoch`, so every prompt is used once per epoch and a run is
reproducible from its seed; `state_dict()` captures the position so that a resumed run draws exactly the batches the
uninterrupted run would have drawn. When an epoch runs out mid-batch the batch is completed from the next epoch; to
keep prompts distinct within a batch, that next epoch's permutation is stably rearranged so that its first items
avoid the prompts the batch already holds (they move just behind those items; the epoch still contains every prompt
exactly once), which is always possible when prompts_per_step <= num_prompts. If prompts_per_step > num_prompts a
batch necessarily repeats prompts: it spans several epochs, and duplicates within the batch are allowed there.
"""

from __future__ import annotations

import torch

from .prompts import PromptRecord, PromptSet

__all__ = ["ListPromptSource", "PromptSampler", "StreamPromptSource"]


def _arrange(perm: list[int], exclude: set[int], need: int) -> list[int]:
    """Stable reorder of `perm` putting its first `need` items not in `exclude` at the front."""
    if not exclude:
        return perm
    front: list[int] = []
    rest: list[int] = []
    for i in perm:
        (front if len(front) < need and i not in exclude else rest).append(i)
    return front + rest


class PromptSampler:
    """Draws `prompts_per_step` distinct prompt indices per step, epoch by epoch, from a seed."""

    def __init__(self, num_prompts: int, prompts_per_step: int, seed: int):
        for name, v in (("num_prompts", num_prompts), ("prompts_per_step", prompts_per_step)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"PromptSampler: {name} must be a positive int, got {v!r}")
        self.num_prompts = num_prompts
        self.prompts_per_step = prompts_per_step
        self.seed = int(seed)
        self._epoch = 0
        self._position = 0
        # what the batch straddling into the current epoch already held, and how many it still needed:
        # enough to rebuild the current epoch's order on resume
        self._wrap_exclude: list[int] = []
        self._wrap_need = 0
        self._order: list[int] | None = None

    # ------------------------------------------------------------------------------------------ sampling

    @property
    def epoch(self) -> int:
        return self._epoch

    def _epoch_order(self) -> list[int]:
        if self._order is None:
            g = torch.Generator().manual_seed(self.seed + self._epoch)
            perm = torch.randperm(self.num_prompts, generator=g).tolist()
            self._order = _arrange(perm, set(self._wrap_exclude), self._wrap_need)
        return self._order

    def _start_epoch(self, exclude: list[int]) -> None:
        self._epoch += 1
        self._position = 0
        self._wrap_exclude = list(exclude)
        self._wrap_need = self.prompts_per_step - len(exclude)
        self._order = None

    def next_prompts(self) -> list[int]:
        """The next `prompts_per_step` prompt indices."""
        picked: list[int] = []
        while len(picked) < self.prompts_per_step:
            if self._position >= self.num_prompts:
                self._start_epoch(picked)
            picked.append(self._epoch_order()[self._position])
            self._position += 1
        return picked

    # ------------------------------------------------------------------------------------------- resume

    def state_dict(self) -> dict:
        """Position plus the config it is valid for (checked on load: resuming with a different prompt
        file or batch shape would otherwise silently draw a different sequence)."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "wrap_exclude": list(self._wrap_exclude),
            "wrap_need": self._wrap_need,
            "num_prompts": self.num_prompts,
            "prompts_per_step": self.prompts_per_step,
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict) -> None:
        for key in ("num_prompts", "prompts_per_step", "seed"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"PromptSampler state was saved with {key}={state[key]}, this sampler has {getattr(self, key)}"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_prompts:
            raise ValueError(f"invalid PromptSampler state: epoch={epoch}, position={position}")
        self._epoch = epoch
        self._position = position
        self._wrap_exclude = [int(i) for i in state.get("wrap_exclude", [])]
        self._wrap_need = int(state.get("wrap_need", 0))
        self._order = None


class ListPromptSource:
    def __init__(self, prompts: PromptSet, prompts_per_step: int, seed: int):
        self.prompts = prompts
        self.sampler = PromptSampler(len(prompts), prompts_per_step, seed)

    def next_prompts(self) -> list[PromptRecord]:
        return [self.prompts[i] for i in self.sampler.next_prompts()]

    def state_dict(self) -> dict:
        return {"kind": "list", **self.sampler.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        state = dict(state)
        if state.pop("kind", "list") != "list":
            raise ValueError("checkpoint was written with data.source wds, this run reads a prompt list")
        self.sampler.load_state_dict(state)

    @property
    def skipped(self) -> int:
        return self.prompts.skipped


def stream_share(prompts_per_step: int, world_size: int, rank: int, call: int) -> int:
    """The prompts rank `rank` reads at its `call`-th step of a wds stream: prompts_per_step // world_size, and one
    more for prompts_per_step % world_size of the ranks, chosen in rotation so that every rank reads the same number
    over world_size steps (Flow-GRPO's 48 prompts on 32 GPUs: 16 ranks read 2 and 16 read 1, alternating)."""
    base, extra = divmod(prompts_per_step, world_size)
    return base + int((rank - call * extra) % world_size < extra)


class StreamPromptSource:
    """A step's prompts streamed from webdataset shards: each rank reads its share (stream_share) from its own
    readers (shards.py) and every rank gets the whole step's, gathered in rank order."""

    def __init__(self, urls, prompts_per_step: int, seed: int, dist, num_workers: int = 0):
        from .shards import ShardPromptStream

        self.dist, self.prompts_per_step, self.calls = dist, prompts_per_step, 0
        self.stream = ShardPromptStream(urls, seed=seed, rank=dist.rank, world_size=dist.world_size,
                                        num_workers=num_workers)

    def next_prompts(self) -> list[PromptRecord]:
        from .shards import ShardReadError

        n = stream_share(self.prompts_per_step, self.dist.world_size, self.dist.rank, self.calls)
        self.calls += 1
        try:
            mine = ("ok", [(r.prompt, r.metadata) for r in self.stream.next_records(n)])
        except ShardReadError as err:  # still gathered: a rank that raised alone would leave the others waiting
            mine = ("error", str(err))
        parts = self.dist.all_gather_object(mine)
        failed = [(rank, why) for rank, (kind, why) in enumerate(parts) if kind == "error"]
        if failed:  # every rank stops with the first one's reason (the run's data is broken, not this rank)
            rank, why = failed[0]
            raise ShardReadError(why if len(parts) == 1 else f"rank {rank}'s prompt stream: {why}")
        return [PromptRecord(p, m) for _, part in parts for p, m in part]

    def state_dict(self) -> dict:
        return {"kind": "wds", "ranks": self.dist.all_gather_object(self.stream.state_dict()), "calls": self.calls}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "wds":
            raise ValueError("checkpoint was written with a prompt list, this run streams data.source wds")
        ranks = state["ranks"]
        if len(ranks) != self.dist.world_size:
            raise ValueError(f"the prompt stream position was saved by {len(ranks)} ranks, this run has "
                             f"{self.dist.world_size}: a wds stream resumes only on the same world size")
        self.stream.load_state_dict(ranks[self.dist.rank])
        self.calls = int(state.get("calls", 0))  # older checkpoints: shares were equal, the rotation moot

    @property
    def skipped(self) -> int:
        return int(sum(self.stream.skipped.values()))

    def close(self) -> None:
        self.stream.close()
