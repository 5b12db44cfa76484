"""StreamPromptSource (data.source wds) on any world size: a rank's share of a step's prompts (stream_share) and the
step's prompts gathered by every rank, on ranks simulated by threads (the real stream readers and source, a
barrier for the all-gather)."""

import threading

import pytest
from extras import need
from thread_ranks import ThreadDist

need("webdataset")

from jagg_scale.data import PromptRecord, StreamPromptSource, shard_pattern, write_prompt_shards  # noqa: E402
from jagg_scale.data.source import stream_share  # noqa: E402


@pytest.mark.parametrize("world", [1, 2, 3, 8, 32])
def test_every_step_reads_prompts_per_step_and_every_rank_the_same_over_world_steps(world):
    for prompts in range(1, 70):
        per_rank = [0] * world
        for call in range(2 * world):
            shares = [stream_share(prompts, world, r, call) for r in range(world)]
            assert sum(shares) == prompts and max(shares) - min(shares) <= 1
            for r, n in enumerate(shares):
                per_rank[r] += n
        assert per_rank == [2 * prompts] * world  # balanced: no rank's readers run ahead of the others'


def _run(urls, world, prompts, steps, state=None):
    """Each rank's gathered prompts per step (and each rank's state after them)."""
    dist = ThreadDist(world)
    out, states, errors = [None] * world, [None] * world, []

    def rank(r):
        try:
            src = StreamPromptSource(urls, prompts, seed=3, dist=dist.rank_view(r))
            if state is not None:
                src.load_state_dict(state)
            out[r] = [[p.prompt for p in src.next_prompts()] for _ in range(steps)]
            states[r] = src.state_dict()
            src.close()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
            dist.barrier.abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return out, states[0]


def test_a_step_count_that_does_not_divide_the_world_streams_and_resumes(tmp_path):
    """5 prompts per step on 3 ranks (was refused): every rank gets the same 5 prompts of a step, no prompt twice
    before the shards are read through, and a resume continues the rotation and the streams exactly."""
    records = [PromptRecord(f"prompt {i}", {"i": i}) for i in range(60)]
    shards = write_prompt_shards(records, tmp_path / "shards", shard_size=10)
    urls = shard_pattern(tmp_path / "shards", "prompts", len(shards))
    full, _ = _run(urls, world=3, prompts=5, steps=4)
    assert all(full[r] == full[0] for r in range(3))
    steps = full[0]
    assert all(len(s) == 5 for s in steps)
    seen = [p for s in steps for p in s]
    assert len(set(seen)) == len(seen) == 20
    first, state = _run(urls, world=3, prompts=5, steps=2)
    assert first[0] == steps[:2] and state["calls"] == 2
    rest, _ = _run(urls, world=3, prompts=5, steps=2, state=state)
    assert rest[0] == steps[2:]
