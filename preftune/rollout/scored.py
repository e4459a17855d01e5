"""A scored generation batch: the rollout plus its rewards, before advantages."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from preftune.rollout.sampler import Rollout


@dataclass
class Scored:
    rollout: Rollout
    per_func: torch.Tensor  # (N, F) NaN where a function returned None
    total: torch.Tensor  # (N,) weighted sum; NaN where no function applied
    names: list[str]
    group_sizes: list[int]  # rows per prompt, group-contiguous
    extra: dict = field(default_factory=dict)


def group_spread(total: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Bessel std of each group ignoring NaN rows (0 with fewer than two valid rows). -> (n_groups,)"""
    out = []
    for g in torch.split(total, sizes):
        v = g[~g.isnan()]
        out.append(v.std() if v.numel() >= 2 else torch.zeros((), dtype=total.dtype))
    return torch.stack(out) if out else torch.zeros(0)
