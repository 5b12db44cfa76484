"""Rollout and training on separate rank pools of one launch, the rollout at most k steps ahead (issue 38).

    pools.rollout_ranks R, pools.max_staleness k (config.py)

    trainer pool (ranks 0 .. N-R-1)      the run as today on N - R ranks: engine (FSDP2 / one process), update,
                                         checkpoints, logs, evaluation; receives each step's rollout, sends the
                                         weights after each update (trainer_link.py)
    rollout pool (ranks N-R .. N-1)      a replica of the policy per rank: samples its trainers' rows, decodes and
                                         scores them, sends them; binds each policy version it is sent, checked
                                         (rollout_pool.py)
    bridge                               point-to-point messages between the pools, bounded and timed (bridge.py),
                                         on a group of its own beside each pool's (world.py)

Step s is sampled with the weights after step max(0, s - k), exactly, so k = 0 is the synchronous step bit for bit
and a run resumed from a checkpoint (which holds the k earlier versions the next rollouts sample with) continues as
the uninterrupted run did. docs/async.md has the protocol, what is checked, the deadlines and what is not done yet."""
