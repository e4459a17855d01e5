"""A scored generation batch: the rollout plus its rewards, before advantages."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from preftune.rewards.functions import RewardLog
from preftune.rollout.sampler import Rollout


@dataclass
class Scored:
    rollout: Rollout
    per_func: torch.Tensor  # (N, F) NaN where a function returned None
    total: torch.Tensor  # (N,) weighted sum; NaN where no function applied
    names: list[str]
    group_sizes: list[int]  # rows per prompt, group-contiguous
    extra: dict = field(default_factory=dict)
    # the reward functions' log_metric / log_extra
    log: RewardLog = field(default_factory=RewardLog)
    # a tool loop's rows (`rollout/agent.Trajectory`)
    trajectories: list = field(default_factory=list)
