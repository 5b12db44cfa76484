"""Ranks simulated by threads for code whose only collective is `all_gather_object` (the prompt sources):
`ThreadDist(world).rank_view(r)` is rank r's dist, its gather a barrier over the threads, in rank order."""

import threading


class ThreadDist:
    """world_size ranks as threads: all_gather_object waits for every rank (a barrier), rank order kept."""

    def __init__(self, world_size: int):
        self.world_size, self.slots = world_size, [None] * world_size
        self.barrier = threading.Barrier(world_size)

    def rank_view(self, rank: int) -> "RankView":
        return RankView(self, rank)


class RankView:
    def __init__(self, dist: ThreadDist, rank: int):
        self.dist, self.rank, self.world_size = dist, rank, dist.world_size

    def all_gather_object(self, obj):
        self.dist.slots[self.rank] = obj
        self.dist.barrier.wait()
        out = list(self.dist.slots)
        self.dist.barrier.wait()
        return out
