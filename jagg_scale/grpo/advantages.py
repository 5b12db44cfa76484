"""Group-relative advantages: A = (r - mean of the prompt's group) / (std + 1e-4), clipped.

A group whose rewards are all equal carries no preference signal: its advantages are exactly zero and the group
is masked out of the loss, so it neither dilutes the batch mean nor pulls through the KL term. Equality is tested
exactly (max == min), not through a float32 std: identical rewards that are not exact in binary (0.826, partial OCR
scores that saturate) give a float32 std of ~1e-7, which would leave the group in with meaningless advantages of
up to ~1e-2. The statistics are float64, as Flow-GRPO's stat tracker computes them. Such groups are counted,
because many of them mean the reward has saturated or the group size is too small.

Several rewards (MixGRPO's aggregation, `combine_advantages`) are combined first and clipped after, so
|A| <= adv_clip_max always holds in the loss.

`gdpo_advantages` is Flow-Factory's `gdpo` aggregation (X-GenGroup/Flow-Factory a0b2bc5,
src/flow_factory/advantage/advantage_processor.py:403-481, the default of its GRPO and NFT trainers,
hparams/training_args.py:418-421 and 464-467): each reward normalised in its group, (r - mean) / max(std, 1e-6) with the
population std (l. 459-464), weighted and summed (l. 465, 468), then the sum normalised over the whole batch,
(x - mean) / max(std, 1e-6) (l. 469-470, `_global_mean_std` l. 260-262); its trainer clips after
(trainers/grpo.py:268-269). With one reward too: the batch normalisation rescales the group advantages by 1 / the
batch's std (about 1 / sqrt(the fraction of groups with signal)), which `sum` does not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4
GDPO_STD_FLOOR = 1e-6  # Flow-Factory's max(std, 1e-6) (advantage_processor.py:262, 463)


@dataclass
class Advantages:
    values: torch.Tensor  # float32 [N]
    mask: torch.Tensor  # bool [N]: False for samples of zero-std groups and failed rewards
    zero_std_groups: int
    num_groups: int


def compute_advantages(
    rewards: torch.Tensor,
    group_ids: list,
    *,
    global_std: bool = False,
    adv_clip_max: float = 5.0,
    valid: torch.Tensor | None = None,
) -> Advantages:
    """Per-prompt advantages. `group_ids[i]` names the prompt of sample i (equal ids share a group); `valid`
    marks samples whose reward succeeded: invalid ones are left out of the statistics and masked."""
    adv, mask, zero_std, num_groups = _group_normalise(rewards, group_ids, valid, lambda sd: sd + STD_EPS,
                                                       global_std=global_std)
    return Advantages(values=adv.clamp(-adv_clip_max, adv_clip_max).float(), mask=mask, zero_std_groups=zero_std,
                      num_groups=num_groups)


def _group_normalise(rewards: torch.Tensor, group_ids: list, valid: torch.Tensor | None, scale,
                     *, global_std: bool = False) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(r - group mean) / scale(std) in float64 over each group's valid samples (population std: the group's, or
    the valid batch's with global_std), 0 elsewhere; the mask (valid, and in a group whose rewards differ), the
    zero-std groups and the number of groups."""
    rewards = rewards.double()
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    adv = torch.zeros_like(rewards)
    mask = valid.clone()
    values, ok = rewards.tolist(), valid.tolist()  # the group bookkeeping reads the values once, as Python floats
    global_sd = rewards[valid].std(unbiased=False) if sum(ok) > 1 else rewards.new_zeros(())
    groups = _groups(group_ids)
    zero_std = 0
    for members in groups.values():
        members = [i for i in members if ok[i]]
        if not members:
            continue
        idx = torch.tensor(members)
        r = rewards[idx]
        if len({values[i] for i in members}) == 1:  # exactly equal (NaN never is): no signal
            zero_std += 1
            mask[idx] = False
            continue
        sd = global_sd if global_std else r.std(unbiased=False)
        adv[idx] = (r - r.mean()) / scale(sd)
    return adv, mask, zero_std, len(groups)


def _groups(group_ids: list) -> dict:
    groups: dict = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    return groups


def combine_advantages(parts: list[tuple[float, Advantages]], group_ids: list, valid: torch.Tensor, *,
                       adv_clip_max: float = 5.0) -> Advantages:
    """MixGRPO's aggregation: A = clip(sum_c w_c A_c) of per-reward group-normalised advantages, clipped to
    +-adv_clip_max after the combination. A sample trains when all its rewards succeeded (`valid`) and at least one
    reward separates its group; groups where none does are the zero-std groups of the mix."""
    values = sum(w * a.values for w, a in parts).clamp(-adv_clip_max, adv_clip_max)
    return _mixed(values, [a.mask for _, a in parts], group_ids, valid)


def gdpo_advantages(parts: list[tuple[float, torch.Tensor, torch.Tensor]], group_ids: list, valid: torch.Tensor, *,
                    adv_clip_max: float = 5.0) -> Advantages:
    """Flow-Factory's gdpo (module docstring) of `parts` = (weight, rewards, valid) per reward, one reward or
    several: x = sum_c w_c (r_c - group mean) / max(group std, 1e-6), A = clip((x - mean x) / max(std x, 1e-6)),
    every statistic float64 and population, as its NumPy code computes them. A reward whose group is all equal
    adds exactly 0 there (Flow-Factory: 0 up to the rounding of the group mean).

    Failed rewards, which Flow-Factory has no notion of (a reward that raises stops its run): a row's failed reward
    is left out of that reward's group statistics (as `sum` and `advantage` leave it out), the batch statistics are
    taken over the rows whose rewards all succeeded (`valid`), and failed rows are masked. Rows of groups that no
    reward separates hold x = 0 and stay in the batch statistics, as in Flow-Factory, but are masked out of the loss
    (Flow-Factory trains them with A = -mean x / std x, about 0: only its loss mean's denominator counts them)."""
    valid = valid.bool()
    normalised = [(w, _group_normalise(r, group_ids, ok, lambda sd: sd.clamp(min=GDPO_STD_FLOOR)))
                  for w, r, ok in parts]
    x = sum(w * adv for w, (adv, *_) in normalised)
    kept = x[valid]
    mean = kept.mean() if len(kept) else x.new_zeros(())
    std = (kept.std(unbiased=False) if len(kept) else x.new_zeros(())).clamp(min=GDPO_STD_FLOOR)
    values = ((x - mean) / std).clamp(-adv_clip_max, adv_clip_max).float()
    return _mixed(values, [mask for _, (_, mask, *_) in normalised], group_ids, valid)


def _mixed(values: torch.Tensor, masks: list[torch.Tensor], group_ids: list, valid: torch.Tensor) -> Advantages:
    """Several rewards' advantages combined into `values`: a sample trains when all its rewards succeeded (`valid`)
    and at least one reward separates its group (its mask); groups where none does are the zero-std groups."""
    signal = torch.stack(masks).any(0)
    mask = valid.bool() & signal
    groups = _groups(group_ids)
    zero = sum(1 for members in groups.values() if not signal[torch.tensor(members)].any())
    return Advantages(values=torch.where(mask, values, torch.zeros_like(values)), mask=mask, zero_std_groups=zero,
                      num_groups=len(groups))
