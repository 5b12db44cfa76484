"""DiffusionNFT's training draws per inner epoch (train/nft.py): each inner epoch draws every sample's training
timesteps and noise afresh, as DiffusionNFT (scripts/train_nft_sd3.py:806-812, 868), seeded by (run.seed, step,
epoch, row) so that N ranks and a resumed run draw what one uninterrupted process draws; nft.adv_mode reaches the
loss's optimality."""

from pathlib import Path

import pytest
import torch

from jagg_scale.train import Trainer, load_config
from jagg_scale.train.nft import NOISE_STREAM, TIMESTEP_STREAM
from jagg_scale.train.rows import StepRows, row_seed

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny_cpu.yaml"
NFT = ["train.algorithm=nft", "model.dit.hidden_size=32", "model.dit.depth=1", "model.dit.image_size=16",
       "sampling.num_steps=6", "sampling.chunk_size=8", "train.prompts_per_step=2", "train.minibatch_size=4",
       "grpo.timestep_fraction=0.8", "log.progress=false", "nft.kl_beta=0", "jagg.mode=exact", "eval.enabled=false"]


def _fresh_draw(seed, step, epoch, row, sigmas, K, shape):
    """A row's timesteps and noise (one draw per timestep, nft.noise per_timestep) of inner epoch `epoch`, drawn
    directly from generators seeded by (seed, step, epoch, row): a random permutation's first K of the schedule's
    noise levels, high to low, and K standard normal draws."""
    g = torch.Generator().manual_seed(row_seed(seed, step, TIMESTEP_STREAM, row, epoch))
    t = torch.sort(torch.tensor(sigmas)[torch.randperm(len(sigmas), generator=g)[:K]], descending=True).values
    e = torch.randn(K, *shape, generator=torch.Generator().manual_seed(row_seed(seed, step, NOISE_STREAM, row, epoch)))
    return t, e


def test_each_inner_epoch_trains_on_fresh_timesteps_and_noise_and_its_adv_mode(tmp_path):
    """A step of two inner epochs: every row's training timesteps and noise in the second differ from the first's,
    and each epoch's are the draw of generators seeded by (seed, step, epoch, row). nft.adv_mode one_only reaches
    the loss: r is 1/2 + 1 / (2 adv_clip_max) for a better-than-average sample, 1/2 for the rest."""
    trainer = Trainer(load_config(TINY, NFT + ["grpo.inner_epochs=2", "train.steps=1", "nft.adv_mode=one_only",
                                               f"run.output_dir={tmp_path}"]))
    up, seen = trainer.algorithm, []
    batch_of = up._batch

    def record(traj, mb_cond, r, local, global_rows, minibatch, step, epoch):
        batch = batch_of(traj, mb_cond, r, local, global_rows, minibatch, step, epoch)
        seen.append((len(seen) // 2, step, global_rows.tolist(), batch))  # 8 rows in minibatches of 4: 2 an epoch
        return batch

    up._batch = record
    trainer.fit()
    trainer.close()
    assert [e for e, *_ in seen] == [0, 0, 1, 1]
    draws = {}
    for epoch, step, rows, b in seen:
        for i, row in enumerate(rows):
            t, d = b.t[:, i], b.clean[i]
            draws[epoch, row] = (t, (b.noised[:, i] - (1 - t)[:, None, None, None] * d) / t[:, None, None, None])
            want_t, want_e = _fresh_draw(0, step, epoch, row, up.sigmas, up.K, d.shape)
            assert torch.equal(t, want_t.float()), (epoch, row)
            torch.testing.assert_close(draws[epoch, row][1], want_e, rtol=1e-4, atol=1e-4)
    assert {row for _, row in draws} == set(range(8))
    for row in range(8):
        assert not torch.allclose(draws[0, row][1], draws[1, row][1], atol=0.1), row  # 4 fresh draws of 3 x 16 x 16
    changed = sum(not torch.equal(draws[0, row][0], draws[1, row][0]) for row in range(8))
    assert changed >= 4  # 4 of 6 levels: the same 4 again has chance 1 / 15 per row
    r = torch.cat([b.optimality for *_, b in seen])
    assert torch.unique(r).tolist() == torch.tensor([0.5, 0.5 + 1 / (2 * 5.0)]).tolist()


@pytest.mark.parametrize("timesteps", ["per_row", "per_batch"])
def test_the_draws_of_every_epoch_are_the_same_on_any_ranks_and_after_a_resume(tmp_path, timesteps):
    """The training draws of each (epoch, row) over the minibatches of 1, 2 and 4 ranks (the rows each rank holds,
    rows.py) and from a second NFT unit (a resumed run's) are the same; per_batch gives a whole minibatch, on every
    rank, the draw of its first row, and a fresh one each epoch. (A later inner epoch's minibatches differ with the
    world size, rows.py keeping rows on their rank: per_batch's draws are then the same per minibatch, not per row.)"""
    over = NFT + [f"nft.timesteps={timesteps}", "nft.noise=per_window", "jagg.mode=jagg", "jagg.window=3"]
    ups = [Trainer(load_config(TINY, over + [f"run.output_dir={tmp_path / str(i)}"])).algorithm for i in range(2)]
    layouts = []
    for up, world in ((ups[0], 1), (ups[0], 2), (ups[0], 4), (ups[1], 1)):
        got = {}
        for rank in range(world):
            rows = StepRows.draw(8, 4, seed=0, step=5, rank=rank, world_size=world)
            for epoch in range(3):
                for local, minibatch in rows.minibatches(epoch, 0, 5):
                    mine = rows.mine[local]
                    t = up._timesteps(5, epoch, mine, minibatch)
                    e = up._noise(5, epoch, mine, (2, 2))
                    for i, row in enumerate(mine.tolist()):
                        assert (epoch, row) not in got
                        got[epoch, row] = (t[:, i], e[:, i], minibatch[0].item())
        assert len(got) == 3 * 8
        layouts.append(got)
    one, resumed = layouts[0], layouts[3]  # one process; the second unit's, on one process too
    for got in layouts[1:]:
        for (epoch, row), (t, e, _) in one.items():
            assert torch.equal(got[epoch, row][1], e), (epoch, row)
            same_minibatches = got is resumed or epoch == 0
            assert torch.equal(got[epoch, row][0], t) or (timesteps == "per_batch" and not same_minibatches)
    for row in range(8):
        assert not torch.equal(one[0, row][1], one[1, row][1])  # fresh noise every epoch
    if timesteps == "per_batch":
        for got in layouts:  # each minibatch's rows share the draw of its first row, on every rank
            for (epoch, _row), (t, _, first) in got.items():
                assert torch.equal(t, got[epoch, first][0])
        draws = [{tuple(one[epoch, row][0].tolist()) for row in range(8)} for epoch in range(3)]
        assert [len(d) for d in draws] == [2, 2, 2] and draws[0] != draws[1]  # 2 minibatches, fresh each epoch
