"""sampling.same_initial_noise (train/rows.py initial_noise): every row of a prompt group starts from its group's x_0,
drawn per (run seed, step, group), the same on any split of the rows over ranks and chunks, while each row's SDE noise
stays its own; off (the default), every row its own x_0 as before; refused where the rollout is deterministic."""

from pathlib import Path

import pytest
import torch

from jagg_scale.models import build_model
from jagg_scale.train import ConfigError, load_config
from jagg_scale.train.policy import Policy
from jagg_scale.train.rows import StepRows, initial_noise, row_generators

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "configs" / "tiny_cpu.yaml")
SMALL = ["model.dit.image_size=8", "model.dit.patch_size=2", "model.dit.hidden_size=32", "model.dit.depth=1",
         "model.dit.num_heads=2", "sampling.num_steps=4", "train.prompts_per_step=3", "grpo.group_size=4",
         "train.minibatch_size=12", "log.progress=false", "jagg.window=2"]
SHAPE = (3, 4, 4)
G = 4


def x0(rows: torch.Tensor, group_size: int | None, seed: int = 7, step: int = 3) -> torch.Tensor:
    return initial_noise(row_generators(seed, step, rows), rows, SHAPE, seed=seed, step=step, group_size=group_size)


def test_rows_of_a_group_start_together_and_groups_apart():
    rows = torch.arange(12)
    x = x0(rows, G)
    for g in range(3):
        assert all(torch.equal(x[i], x[g * G]) for i in range(g * G, (g + 1) * G))
    assert not torch.equal(x[0], x[G]) and not torch.equal(x[G], x[2 * G])
    assert not torch.equal(x0(rows, G, step=4)[0], x[0]) and not torch.equal(x0(rows, G, seed=8)[0], x[0])


def test_off_each_row_starts_from_its_own_draw_as_before():
    rows = torch.arange(12)
    x = x0(rows, None)
    mine = torch.stack([torch.randn(SHAPE, generator=g) for g in row_generators(7, 3, rows)])
    assert torch.equal(x, mine) and not torch.equal(x[0], x[1])


def test_two_ranks_and_any_chunking_draw_what_one_process_draws():
    """The rows of a step dealt to 2 ranks (StepRows), each rank's rows in chunks of 5: every row's x_0 is the one
    one process gives it (x_0 depends on the row's group alone), and each row's generator is left where it is left
    without the option, so its SDE noise is unchanged."""
    one = x0(torch.arange(12), G)
    for world in (1, 2):
        for rank in range(world):
            rows = StepRows.draw(12, 6, seed=7, step=3, rank=rank, world_size=world).mine
            for start in range(0, len(rows), 5):
                chunk = rows[start:start + 5]
                shared, own = row_generators(7, 3, chunk), row_generators(7, 3, chunk)
                assert torch.equal(initial_noise(shared, chunk, SHAPE, seed=7, step=3, group_size=G), one[chunk])
                initial_noise(own, chunk, SHAPE, seed=7, step=3)
                for a, b in zip(shared, own):  # the next draws (the SDE's) are the default run's
                    assert torch.equal(torch.randn(SHAPE, generator=a), torch.randn(SHAPE, generator=b))


def _rollout(*extra):
    cfg = load_config(TINY, SMALL + list(extra))
    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg.model)
    policy = Policy(model, cfg, torch.device("cpu"), rollout_batch=5)  # groups cut across chunks
    prompts = [p for p in ("a cat", "a dog", "a tree") for _ in range(G)]
    return policy.rollout(policy.encode(prompts), torch.arange(12), step=2)


def test_the_rollout_starts_a_group_together_and_its_trajectories_part():
    same, own = _rollout("sampling.same_initial_noise=true"), _rollout()
    start, end = same.latents[0], same.latents[-1]
    for g in range(3):
        rows = range(g * G, (g + 1) * G)
        assert all(torch.equal(start[i], start[g * G]) for i in rows)
        assert all((end[i] - end[g * G]).abs().max() > 1e-3 for i in rows if i != g * G)  # the SDE noise differs
    assert not torch.equal(start[0], start[G])
    assert not torch.equal(own.latents[0][0], own.latents[0][1])  # off: each row its own start


def test_refused_where_the_rollout_is_deterministic():
    with pytest.raises(ConfigError, match="'sampling.same_initial_noise'.*deterministic ODE"):
        load_config(TINY, SMALL + ["sampling.same_initial_noise=true", "train.algorithm=nft"])
