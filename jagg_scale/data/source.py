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
"""

from __future__ import annotations

from .prompts import PromptRecord, PromptSet
from .sampler import PromptSampler

__all__ = ["ListPromptSource", "StreamPromptSource"]


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


class StreamPromptSource:
    def __init__(self, urls, prompts_per_step: int, seed: int, dist, num_workers: int = 0):
        from .shards import ShardPromptStream

        if prompts_per_step % dist.world_size:
            raise ValueError(f"data.source wds: train.prompts_per_step={prompts_per_step} must be divisible by the "
                             f"world size {dist.world_size} (each rank streams its share)")
        self.dist = dist
        self.per_rank = prompts_per_step // dist.world_size
        self.stream = ShardPromptStream(urls, seed=seed, rank=dist.rank, world_size=dist.world_size,
                                        num_workers=num_workers)

    def next_prompts(self) -> list[PromptRecord]:
        mine = self.stream.next_records(self.per_rank)
        parts = self.dist.all_gather_object([(r.prompt, r.metadata) for r in mine])
        return [PromptRecord(p, m) for part in parts for p, m in part]

    def state_dict(self) -> dict:
        return {"kind": "wds", "ranks": self.dist.all_gather_object(self.stream.state_dict())}

    def load_state_dict(self, state: dict) -> None:
        if state.get("kind") != "wds":
            raise ValueError("checkpoint was written with a prompt list, this run streams data.source wds")
        ranks = state["ranks"]
        if len(ranks) != self.dist.world_size:
            raise ValueError(f"the prompt stream position was saved by {len(ranks)} ranks, this run has "
                             f"{self.dist.world_size}: a wds stream resumes only on the same world size")
        self.stream.load_state_dict(ranks[self.dist.rank])

    @property
    def skipped(self) -> int:
        return int(sum(self.stream.skipped.values()))

    def close(self) -> None:
        self.stream.close()
