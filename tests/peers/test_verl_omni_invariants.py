"""verl-omni's published CPU invariants, run on our code with its inputs and expected outputs.

Source: verl-project/verl-omni a1139ba, tests/trainer/diffusion/test_diffusion_core_algos_on_cpu.py (cited as
`core:LINE`) and tests/pipelines/test_request_batch_sde_windows_on_cpu.py (`windows:LINE`); the functions they test
are verl_omni/trainer/diffusion/diffusion_algos.py (`algos:LINE`) and verl_omni/pipelines/request_batch.py
(`request_batch:LINE`).

Where our convention differs from verl-omni's, the test asserts ours and says how it relates to theirs:

  std       ours is the population std (unbiased=False, as Flow-GRPO's np.std in its stat tracker, the peer our
            Flow-GRPO recipes reproduce); verl-omni's torch.std is Bessel-corrected (algos:236, :256, :905,
            :918). For a group of n, theirs is sqrt(n / (n - 1)) x ours: at n = 2 the advantages differ by
            sqrt(2), at Flow-GRPO's group of 24 by 2.1%. Both divide by std + 1e-4 (algos:195, :261, :889, :925).
  one-row   a prompt with one sample (or equal rewards): verl-omni gives advantage 0 and keeps the row in the loss's
  groups    mean (algos:244-245, :915-925); ours gives 0 and masks the row out of the loss (grpo/advantages.py).
  no std    verl-omni's norm_adv_by_std_in_grpo=False (Dr.GRPO, algos:263) has no counterpart here: our advantages
            are always std-normalised (Flow-GRPO, DanceGRPO, DiffusionNFT and Flow-Factory all normalise). Its
            expected values are asserted of our mean-centred numerator instead.
  clip      verl-omni's advantage function does not clip (its losses clamp to adv_clip_max); ours clips at
            grpo.adv_clip_max when it computes them. Equal in the loss.

Only the Bessel factor could move a recipe: ours that name Flow-GRPO or DiffusionNFT are faithful in it (both
peers' stat trackers take np.std, population, + 1e-4: flow_grpo/stat_tracking.py:26-29 at Flow-GRPO ac4c86e, :27-30 at
DiffusionNFT 24af555); a recipe exact to verl-omni's Flow-GRPO would need a Bessel switch, and we ship none.
"""

from types import SimpleNamespace

import pytest
import torch

from jagg_scale.grpo.advantages import STD_EPS, compute_advantages
from jagg_scale.grpo.steps import select_steps, trained_count
from jagg_scale.jagg import trained_steps
from jagg_scale.nft.loss import optimality
from jagg_scale.train.nft import NFT
from jagg_scale.train.update import GRPO

# core:89-93 and core:279-280: 4 samples, two prompts of 2
REWARDS = torch.tensor([1.0, 3.0, 0.0, 2.0])
UIDS = ["uid-0", "uid-0", "uid-1", "uid-1"]


def test_group_relative_advantages_with_the_group_std():
    """core:83-115 (norm_adv_by_std_in_grpo, global_std False): each group's advantages average to 0. Ours divide by
    the group's population std (1 for {1, 3} and {0, 2}) + 1e-4: -+1 / 1.0001; verl-omni's Bessel std is sqrt(2),
    giving -+0.7071 (module docstring)."""
    adv = compute_advantages(REWARDS, UIDS)
    expected = torch.tensor([-1.0, 1.0, -1.0, 1.0]) / (1.0 + STD_EPS)
    torch.testing.assert_close(adv.values, expected)
    for group in (slice(0, 2), slice(2, 4)):  # core:114-115
        assert abs(float(adv.values[group].mean())) < 1e-6
    assert adv.mask.all() and (adv.zero_std_groups, adv.num_groups) == (0, 2)


def test_group_relative_advantages_with_the_batch_std():
    """core:83-115 with global_std: the group mean still comes off (each group averages to 0) and the scale is the
    whole batch's std: population, sqrt(1.25) over {1, 3, 0, 2} (verl-omni's Bessel one: sqrt(5 / 3))."""
    adv = compute_advantages(REWARDS, UIDS, global_std=True)
    expected = torch.tensor([-1.0, 1.0, -1.0, 1.0]) / (1.25 ** 0.5 + STD_EPS)
    torch.testing.assert_close(adv.values, expected)
    for group in (slice(0, 2), slice(2, 4)):
        assert abs(float(adv.values[group].mean())) < 1e-6


@pytest.mark.parametrize("global_std", [False, True])
def test_the_mean_centred_numerator_is_verl_omnis_unnormalised_advantage(global_std):
    """core:104-111: without the std, verl-omni's advantage is reward - group mean = -1, 1, -1, 1. Ours always
    normalises, so its numerator is the same values times the one scale every row shares (group std 1 here, or the
    batch's): the two differ by that positive scalar only, never in sign or order."""
    adv = compute_advantages(REWARDS, UIDS, global_std=global_std)
    scale = 1.0 + STD_EPS if not global_std else 1.25 ** 0.5 + STD_EPS
    torch.testing.assert_close(adv.values * scale, torch.tensor([-1.0, 1.0, -1.0, 1.0]))


@pytest.mark.parametrize("global_std", [False, True])
def test_a_prompt_with_a_single_sample_has_advantage_zero(global_std):
    """core:24-39 and :506-522 give every sample its own uid: verl-omni's advantage of a one-sample group is its
    reward minus itself, 0 (algos:244-245). Ours is 0 too, and the row is masked out of the loss (no preference
    signal) rather than averaged in; with global_std as without."""
    rewards = torch.randn(8, generator=torch.Generator().manual_seed(0))
    adv = compute_advantages(rewards, [f"uid-{i}" for i in range(8)], global_std=global_std)
    assert torch.equal(adv.values, torch.zeros(8)) and not adv.mask.any()
    assert (adv.zero_std_groups, adv.num_groups) == (8, 8)


def test_the_diffusion_nft_group_advantages_are_the_grpo_ones():
    """core:275-295: DiffusionNFT's group normalisation (algos:884-925) is GRPO's, before the map to an optimality;
    ours is the same function for both algorithms (train/algorithm.py Algorithm.advantages), so the expected values
    of core:288-295 hold for it as they do above; here through the optimality they feed, at adv_clip_max 5:
    r = A / 5 / 2 + 1/2 = 0.4, 0.6, 0.4, 0.6 (to 1e-4 of the std's epsilon)."""
    r = optimality(compute_advantages(REWARDS, UIDS).values, 5.0)
    torch.testing.assert_close(r, torch.tensor([0.4, 0.6, 0.4, 0.6]), atol=1e-4, rtol=0)


# core:300-301: advantages straddling the clip of 5
ADV = torch.tensor([-10.0, -5.0, 0.0, 5.0, 10.0])


@pytest.mark.parametrize("mode,theirs", [("all", "continuous"), ("positive_only", "positive_only"),
                                         ("negative_only", "negative_only"), ("one_only", "one_only"),
                                         ("binary", "binary")])
def test_the_nft_optimality_of_each_adv_mode(mode, theirs):
    """core:298-327, verl-omni's `_advantage_to_reward_prob` (algos:929-944) for each adv_mode; its `continuous` is
    DiffusionNFT's default, which DiffusionNFT and we call `all` (nft/loss.py ADV_MODES). The same clip, mode and
    map r = clip(A / 5 / 2 + 1/2, 0, 1), so the same values."""
    r = optimality(ADV, 5.0, mode)
    assert r.shape == ADV.shape and ((r >= 0) & (r <= 1)).all()  # core:307-308
    expected = {
        "continuous": [0.0, 0.0, 0.5, 1.0, 1.0],  # core:310-314 (clipped to +-5, then mapped)
        "positive_only": [0.5, 0.5, 0.5, 1.0, 1.0],  # core:315-316 asserts >= 0.5
        "negative_only": [0.0, 0.0, 0.5, 0.5, 0.5],  # core:317-318 asserts <= 0.5
        "one_only": [0.5, 0.5, 0.5, 0.6, 0.6],  # core:319-322
        "binary": [0.4, 0.4, 0.5, 0.6, 0.6],  # core:323-327
    }[theirs]
    torch.testing.assert_close(r, torch.tensor(expected), atol=1e-6, rtol=0)
    if theirs == "positive_only":
        assert (r >= 0.5).all()
    if theirs == "negative_only":
        assert (r <= 0.5).all()


def test_nft_trains_int_t_times_the_fraction_timesteps_per_sample_from_the_schedule():
    """core:330-370: T = 6 timesteps at timestep_fraction 0.5 train max(1, int(6 x 0.5)) = 3 per sample (algos:955,
    core:364), each row its own random subset of the schedule's. Ours (train/nft.py NFT._timesteps): the same count,
    K distinct levels of the schedule per row, sorted high noise to low, seeded per (run, step, row, epoch)."""
    assert len(trained_steps(6, 0.5)) == 3
    sigmas = torch.linspace(1.0, 1 / 6, 6).tolist()
    nft = SimpleNamespace(cfg=SimpleNamespace(nft=SimpleNamespace(timesteps="per_row"), run=SimpleNamespace(seed=42)),
                          sigmas=sigmas, K=3)
    rows = torch.arange(4)
    t = NFT._timesteps(nft, 0, 0, rows, rows)
    assert t.shape == (3, 4)
    for b in range(4):
        col = t[:, b].tolist()
        assert len(set(col)) == 3 and set(col) <= set(sigmas) and col == sorted(col, reverse=True)
    assert len({tuple(t[:, b].tolist()) for b in range(4)}) > 1  # rows draw their own (4 rows: 1 in 400 alike)


def _grpo_window(step: int, window: int, lo: int, hi: int, seed: int = 42) -> list[int]:
    grpo = SimpleNamespace(sde_window=window, sde_window_range=[lo, hi], sde_window_mode="random",
                           sde_window_every=1)
    cfg = SimpleNamespace(grpo=grpo, sampling=SimpleNamespace(num_steps=10), run=SimpleNamespace(seed=seed))
    return GRPO.trained_steps_at(SimpleNamespace(cfg=cfg, steps=None), step)


def test_the_sde_window_starts_where_verl_omnis_does():
    """windows:32-34 and request_batch:45-50: a window of 2 in range (0, 5) of 10 steps starts at randint(0, 5 - 2 + 1)
    and covers [start, start + 2): starts 0..3. Ours (grpo.sde_window 2, sde_window_range [0, 5]) draws from the same
    starts, every one of them over enough steps, and trains the window's consecutive steps."""
    windows = [_grpo_window(step, 2, 0, 5) for step in range(200)]
    assert {w[0] for w in windows} == {0, 1, 2, 3}
    assert all(w == [w[0], w[0] + 1] for w in windows)


def test_the_sde_window_does_not_depend_on_how_rows_are_packed():
    """windows:28-51: a sample's window is the one its serial (batch 1) rollout draws, whatever the packing order
    (verl-omni: one generator per request). Ours draws one window per training step from (run seed, step) alone
    (train/update.py GRPO.trained_steps_at): no row, rank, chunk or order enters it, so any packing of the rows
    gets the same window; the per-row step selections (grpo.step_selection random | windows, grpo/steps.py) are
    seeded per global row, so a row's steps are the same in any order and in any subset of rows."""
    assert [_grpo_window(s, 2, 0, 5) for s in range(20)] == [_grpo_window(s, 2, 0, 5) for s in range(20)]
    assert len({_grpo_window(s, 2, 0, 5)[0] for s in range(20)}) > 1  # it does move between steps
    for selection, window in (("random", 1), ("windows", 3)):
        rows = torch.tensor([11, 22, 33])
        serial = [select_steps(selection, 10, 0.5, window, 7, 3, rows[i:i + 1])[:, 0] for i in range(3)]
        order = [2, 0, 1]  # windows:42
        packed = select_steps(selection, 10, 0.5, window, 7, 3, rows[order])
        assert packed.shape == (trained_count(selection, 10, 0.5, window), 3)
        for col, i in enumerate(order):
            assert torch.equal(packed[:, col], serial[i]), (selection, i)
