"""Group-relative advantages (GRPO, DeepSeekMath arXiv:2402.03300, section 4.1.2).

Rewards arrive flat, group-contiguous: rows [k*G, (k+1)*G) are the G completions of prompt k
(online sampling), or groups of unequal sizes (offline traces: the responses each prompt has).
NaN marks a row with no reward (every reward function returned None): it is left out of every
mean and std and gets advantage 0, so it neither shifts its group's baseline nor moves the policy.
Unequal groups are padded with NaN to the largest size, which gives them exactly these semantics.

This module is the one home of NaN-aware reward statistics (advantages, reward_std and
frac_reward_zero_std, dynamic sampling's spread test, eval means).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from preftune.losses.names import ADVANTAGE_ESTIMATORS, SCALE_REWARDS

GroupSizes = int | Sequence[int]  # G for equal groups, or the size of each group in order


def nan_mean_std(x: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-ignoring mean and Bessel-corrected std (n - 1 divisor, as torch.std); std is NaN for n <
    2."""
    valid = ~torch.isnan(x)
    n = valid.sum(dim=dim, keepdim=True).to(x.dtype)
    mean = torch.where(valid, x, 0).sum(dim=dim, keepdim=True) / n  # NaN when n == 0
    sq = torch.where(valid, (x - mean) ** 2, 0).sum(dim=dim, keepdim=True)
    std = torch.sqrt(sq / torch.where(n > 1, n - 1, torch.nan))
    return mean, std


def nanmean(x: torch.Tensor) -> float:
    """Mean of the non-NaN entries as a float (NaN when there are none)."""
    return nan_mean_std(x.reshape(-1), dim=None)[0].item()


def _grouped(rewards: torch.Tensor, sizes: GroupSizes) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(groups (n, Gmax) padded with NaN, flat index of the real rows in it or None when
    unpadded)."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if torch.isinf(rewards).any():
        raise ValueError("rewards must be finite (use NaN for 'no reward')")
    if isinstance(sizes, int):
        if sizes < 1 or rewards.numel() % sizes != 0:
            raise ValueError(f"{rewards.numel()} rewards do not split into groups of "
                             f"num_generations={sizes}")
        return rewards.view(-1, sizes), None  # (N/G, G)
    sizes = list(sizes)
    if sum(sizes) != rewards.numel() or min(sizes, default=1) < 1:
        raise ValueError(f"group sizes {sizes} do not cover {rewards.numel()} rewards")
    if len(set(sizes)) <= 1:
        return rewards.view(len(sizes), -1), None
    width = max(sizes)
    offsets = torch.cat([torch.arange(s, device=rewards.device) for s in sizes])  # (N,)
    index = torch.repeat_interleave(torch.arange(len(sizes), device=rewards.device),
                                    # (N,)
                                    torch.tensor(sizes, device=rewards.device)) * width + offsets
    padded = torch.full((len(sizes) * width,), torch.nan,
                        dtype=rewards.dtype, device=rewards.device)
    padded[index] = rewards
    return padded.view(len(sizes), width), index  # (n, Gmax)


def _ungroup(grouped: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    flat = grouped.reshape(-1)
    return flat if index is None else flat[index]


def group_std(rewards: torch.Tensor, sizes: GroupSizes) -> torch.Tensor:
    """Bessel std of each group's valid rewards, NaN with fewer than two. -> (n_groups,)

    TRL's `frac_reward_zero_std` is the share of groups whose std is close to 0 (NaN is not)."""
    if rewards.numel() == 0:
        return torch.zeros(0, dtype=rewards.dtype)
    _, std = nan_mean_std(_grouped(rewards, sizes)[0], dim=1)  # (n, 1)
    return std.squeeze(1)


def group_spread(rewards: torch.Tensor, sizes: GroupSizes) -> torch.Tensor:
    """`group_std` with 0 where it is undefined. -> (n_groups,)

    `(group_spread(...) == 0)` marks the groups that carry no learning signal (all valid rewards
    equal, or fewer than two): the groups DAPO's dynamic sampling drops.
    """
    return torch.nan_to_num(group_std(rewards, sizes), nan=0.0)


def group_advantages(
    rewards: torch.Tensor, group_sizes: GroupSizes, *, estimator: str = "grpo",
    scale_rewards: str = "group", eps: float = 1e-4,
) -> torch.Tensor:
    """Advantages of flat group-contiguous rewards (N,) -> (N,); `group_sizes` is G (equal groups,
    TRL's num_generations) or the list of group sizes (offline traces). With n_g the valid rewards
    of row i's group g:

    estimator:
        "grpo": A_i = (r_i - mean_g) / (std + eps) (GRPO, DeepSeekMath arXiv:2402.03300), std set by
                scale_rewards:
                "group": Bessel std of the row's group;
                "batch": Bessel std of all valid rewards in the batch, the mean staying per group
                         (PPO-Lite / "Tricks or Traps", arXiv:2508.08221; TRL's "batch");
                "none":  no division (Dr. GRPO, arXiv:2503.20783: std scaling adds a difficulty
                         bias).
        "rloo": A_i = r_i - sum_{j != i} r_j / (n_g - 1), the leave-one-out baseline (RLOO,
                Ahmadian et al. 2024, arXiv:2402.14740; = n_g / (n_g - 1) (r_i - mean_g)); no
                division (TRL's RLOOTrainer with normalize_advantages=False, verl's rloo).
        "reinforce_plus_plus_baseline": c_i = r_i - mean_g, then whitened over the batch,
                A_i = (c_i - mean(c)) / (std(c) + eps) (REINFORCE++, Hu et al. 2025,
                arXiv:2501.03262; verl's name). verl whitens over tokens; this over the valid rows
                (one value per sequence).
    scale_rewards is the grpo estimator's only: rloo divides by nothing,
    reinforce_plus_plus_baseline by the batch std of c. NaN rewards get A = 0 and are excluded from
    every mean and std. A row whose group has a single valid reward has A = 0 (it is its own
    baseline) and is left out of the batch whitening, and so does every row when G == 1. Pass the
    whole generation batch so "batch" and the whitening see every group.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; expected one of "
                         f"{', '.join(SCALE_REWARDS)}")
    if estimator not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown estimator {estimator!r}; expected one of "
                         f"{', '.join(ADVANTAGE_ESTIMATORS)}")
    grouped, index = _grouped(rewards, group_sizes)  # (n, G), NaN-padded when unequal
    mean, group_std = nan_mean_std(grouped, dim=1)  # (n, 1)
    if estimator == "rloo":
        total = torch.nansum(grouped, dim=1, keepdim=True)  # (n, 1)
        # (n, G) mean of the other valid rewards
        others = (total - grouped) / (n_valid(grouped) - 1)
        adv = grouped - others  # 0 / 0 = NaN for a lone reward
    elif estimator == "reinforce_plus_plus_baseline":
        # (n, G): lone rows out
        centred = torch.where(n_valid(grouped) > 1, grouped - mean, torch.nan)
        c_mean, c_std = nan_mean_std(centred, dim=None)
        adv = (centred - c_mean) / (c_std + eps)
    elif scale_rewards == "group":
        adv = (grouped - mean) / (group_std + eps)
    elif scale_rewards == "batch":
        adv = (grouped - mean) / (nan_mean_std(grouped, dim=None)[1] + eps)
    else:
        adv = grouped - mean
    # NaN arises only from a NaN reward, or from fewer than 2 valid rewards in a group (a NaN std or
    # leave-one-out mean, or a row left out of the whitening): all mean "no signal". Infinities were
    # rejected.
    return _ungroup(torch.nan_to_num(adv, nan=0.0), index)


def n_valid(grouped: torch.Tensor) -> torch.Tensor:
    """Valid (non-NaN) rewards per group (n, 1) of grouped rewards (n, G)."""
    return (~torch.isnan(grouped)).sum(dim=1, keepdim=True)
