"""One on-policy minibatch from a Trainer, for the tests that call the update path directly (test_trainer.py,
test_knot_training.py, test_cfg.py): the step's prompts in groups, a rollout of all their rows, advantages spread
evenly over [-1.5, 1.5], every row valid."""

import torch


def rollout_minibatch(trainer, step: int = 0):
    """(cond, batch): the policy's conditioning of the step's rows and their StepBatch."""
    g = trainer.cfg.grpo.group_size
    prompts = [r.prompt for r in trainer.source.next_prompts() for _ in range(g)]
    cond = trainer.policy.encode(prompts)
    traj = trainer.policy.rollout(cond, torch.arange(len(prompts)), step)
    n = len(prompts)
    return cond, traj.step_batch(torch.arange(n), torch.linspace(-1.5, 1.5, n), torch.ones(n, dtype=torch.bool))


def plan_of(**jagg_keys) -> dict:
    """backward_minibatch's planner and intermediate setting for `jagg` section keys (as a config would give them)."""
    from jagg_scale.train.config import JAGGConfig

    cfg = JAGGConfig(**jagg_keys)
    return {"planner": cfg.make_planner(), "intermediate": cfg.intermediate}


def grpo_backward(model_fn, batch, cond, loss, steps, planner, *, intermediate="auto", on_policy: bool, refresh=None,
                  refresh_at="steps", **runner_kw):
    """The runner's backward_minibatch over a GRPO minibatch of the trajectory's `steps` (train/update.py
    step_minibatch, its `refresh` and grpo.refresh_at); `runner_kw`: backward, reduce, planned, micro_batch_size."""
    from jagg_scale.train.runner import backward_minibatch
    from jagg_scale.train.update import step_minibatch

    mb = step_minibatch(batch, cond, loss, steps, intermediate=intermediate, on_policy=on_policy, refresh=refresh,
                        refresh_at=refresh_at)
    return backward_minibatch(model_fn, mb, planner, **runner_kw)
