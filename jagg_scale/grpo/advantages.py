"""Group-relative advantages: A = (r - mean of the prompt's group) / (std + 1e-4), clipped.

A group whose rewards are all equal carries no preference signal: its advantages are exactly zero and the group
is masked out of the loss, so it neither dilutes the batch mean nor pulls through the KL term. Equality is tested
exactly (max == min), not through a float32 std: identical rewards that are not exact in binary (0.826, partial OCR
scores that saturate) give a float32 std of ~1e-7, which would leave the group in with meaningless advantages of
up to ~1e-2. The statistics are float64, as Flow-GRPO's stat tracker computes them. Such groups are counted,
because many of them mean the reward has saturated or the group size is too small.

Several rewards (MixGRPO's aggregation, `combine_advantages`) are combined first and clipped after, so
|A| <= adv_clip_max always holds in the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

STD_EPS = 1e-4


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
    rewards = rewards.double()
    valid = torch.ones_like(rewards, dtype=torch.bool) if valid is None else valid.bool()
    adv = torch.zeros_like(rewards)
    mask = valid.clone()
    values, ok = rewards.tolist(), valid.tolist()  # the group bookkeeping reads the values once, as Python floats
    global_sd = rewards[valid].std(unbiased=False) if sum(ok) > 1 else rewards.new_zeros(())
    groups: dict = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
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
        adv[idx] = (r - r.mean()) / (sd + STD_EPS)
    adv = adv.clamp(-adv_clip_max, adv_clip_max).float()
    return Advantages(values=adv, mask=mask, zero_std_groups=zero_std, num_groups=len(groups))


def combine_advantages(parts: list[tuple[float, Advantages]], group_ids: list, valid: torch.Tensor, *,
                       adv_clip_max: float = 5.0) -> Advantages:
    """MixGRPO's aggregation: A = clip(sum_c w_c A_c) of per-reward group-normalised advantages, clipped to
    +-adv_clip_max after the combination. A sample trains when all its rewards succeeded (`valid`) and at least one
    reward separates its group; groups where none does are the zero-std groups of the mix."""
    values = sum(w * a.values for w, a in parts).clamp(-adv_clip_max, adv_clip_max)
    signal = torch.stack([a.mask for _, a in parts]).any(0)
    mask = valid.bool() & signal
    groups: dict = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    zero = sum(1 for members in groups.values() if not signal[torch.tensor(members)].any())
    return Advantages(values=torch.where(mask, values, torch.zeros_like(values)), mask=mask, zero_std_groups=zero,
                      num_groups=len(groups))
