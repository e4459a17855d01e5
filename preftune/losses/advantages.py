"""Group-relative advantages (GRPO, DeepSeekMath arXiv:2402.03300, section 4.1.2).

Rewards arrive flat, group-contiguous: rows [k*G, (k+1)*G) are the G completions of prompt k.
NaN marks a row with no reward (every reward function returned None): it is left out of every
mean and std and gets advantage 0, so it neither shifts its group's baseline nor moves the policy.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

SCALE_REWARDS = ("group", "batch", "none")


class GroupStats(NamedTuple):
    """Per-row statistics of the row's group, (N,) each; NaN where undefined."""

    mean: torch.Tensor  # mean of the group's valid rewards (NaN if the group has none)
    std: torch.Tensor  # Bessel-corrected std of the group's valid rewards (NaN if fewer than 2)


def _nan_mean_std(x: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN-ignoring mean and Bessel-corrected std (n - 1 divisor, as torch.std); std is NaN for n < 2."""
    valid = ~torch.isnan(x)
    n = valid.sum(dim=dim, keepdim=True).to(x.dtype)
    mean = torch.where(valid, x, 0).sum(dim=dim, keepdim=True) / n  # NaN when n == 0
    sq = torch.where(valid, (x - mean) ** 2, 0).sum(dim=dim, keepdim=True)
    std = torch.sqrt(sq / torch.where(n > 1, n - 1, torch.nan))
    return mean, std


def _grouped(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if num_generations < 1 or rewards.numel() % num_generations != 0:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of num_generations={num_generations}")
    if torch.isinf(rewards).any():
        raise ValueError("rewards must be finite (use NaN for 'no reward')")
    return rewards.view(-1, num_generations)  # (N/G, G)


def group_stats(rewards: torch.Tensor, num_generations: int) -> GroupStats:
    """Mean and std of each row's group, broadcast back to rows: two (N,) tensors.

    A loop logs `frac_reward_zero_std` as `torch.isclose(std, 0).float().mean()`: the share of
    rows whose group carries no learning signal (all valid rewards equal).
    """
    grouped = _grouped(rewards, num_generations)  # (N/G, G)
    mean, std = _nan_mean_std(grouped, dim=1)  # (N/G, 1) each
    return GroupStats(mean.expand_as(grouped).reshape(-1), std.expand_as(grouped).reshape(-1))


def group_advantages(
    rewards: torch.Tensor, num_generations: int, *, scale_rewards: str = "group", eps: float = 1e-4
) -> torch.Tensor:
    """A_i = (r_i - mean_g(i)) / (std + eps) for flat group-contiguous rewards (N,) -> (N,).

    scale_rewards:
        "group": std = Bessel std of the row's group (GRPO).
        "batch": std = Bessel std of all valid rewards in the batch; the mean stays per group
                 (PPO-Lite / "Tricks or Traps", arXiv:2508.08221; TRL's "batch").
        "none":  no division (Dr. GRPO, arXiv:2503.20783: std scaling adds a difficulty bias).
    NaN rewards get A = 0 and are excluded from mean and std. A row whose group has a single
    valid reward has A = 0 (it is its own baseline; its undefined std does not matter), and so
    does every row when G == 1. Pass the whole generation batch so "batch" sees every group.
    """
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale_rewards!r}; expected one of {', '.join(SCALE_REWARDS)}")
    grouped = _grouped(rewards, num_generations)  # (N/G, G)
    mean, group_std = _nan_mean_std(grouped, dim=1)  # (N/G, 1)
    centred = grouped - mean  # (N/G, G)
    if scale_rewards == "group":
        adv = centred / (group_std + eps)
    elif scale_rewards == "batch":
        adv = centred / (_nan_mean_std(grouped, dim=None)[1] + eps)
    else:
        adv = centred
    # NaN arises only from a NaN reward, or from a NaN std (< 2 valid rewards) divided into an
    # exact 0 (a lone reward is its own mean): both mean "no signal". Infinities were rejected.
    return torch.nan_to_num(adv, nan=0.0).reshape(-1)
