"""Which rows each rank samples and trains (train/rows.py): every row once per step, the same minibatches whatever
the world size, and with sequence parallelism the ranks of a group sharing their data rank's rows."""

import torch

from jagg_scale.train.rows import StepRows


def test_every_row_is_sampled_once_and_minibatches_are_the_same_on_any_world():
    one = StepRows.draw(24, 8, seed=3, step=5, rank=0, world_size=1)
    four = [StepRows.draw(24, 8, seed=3, step=5, rank=r, world_size=4) for r in range(4)]
    assert sorted(torch.cat([r.mine for r in four]).tolist()) == list(range(24))
    assert all(r.local_batch == 2 for r in four) and four[0].num_minibatches == 3
    for (_, rows_one), (_, rows_four) in zip(one.minibatches(0, 3, 5), four[0].minibatches(0, 3, 5)):
        assert sorted(rows_one.tolist()) == sorted(rows_four.tolist())  # the same global minibatch


def test_sequence_parallel_groups_share_their_data_ranks_rows():
    """world 4, sp 2: ranks 0, 1 hold data rank 0's rows, ranks 2, 3 data rank 1's - the rows 2 plain ranks hold;
    the all-gather layout lists each row once per rank of its group."""
    dp = [StepRows.draw(24, 8, seed=3, step=5, rank=r, world_size=2) for r in range(2)]
    sp = [StepRows.draw(24, 8, seed=3, step=5, rank=r, world_size=4, sp=2) for r in range(4)]
    assert sp[0].local_batch == dp[0].local_batch == 4
    for r in range(4):
        assert torch.equal(sp[r].mine, dp[r // 2].mine)
    layout = sp[0].all_rows
    assert len(layout) == 48 and torch.equal(layout, torch.cat([dp[0].mine, dp[0].mine, dp[1].mine, dp[1].mine]))
    assert [len(g) for _, g in sp[0].minibatches(0, 3, 5)] == [16] * 3  # each minibatch row once per group rank
