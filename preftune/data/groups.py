"""Offline GRPO groups: the labeled responses of one prompt form its group.

GRPO (Shao et al. 2024, "DeepSeekMath") scores each response against its group:
A_i = (r_i - mean(r)) / (std(r) + eps), computed for groups of any size by
`losses.advantages.group_advantages`. A group of one response, or one whose rewards are all
equal, has A_i = 0 for every response and so gives no gradient; such groups are left out and
counted.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from preftune.data.pairs import group_by_prompt
from preftune.data.traces import Trace
from preftune.errors import UserError


@dataclass
class Group:
    prompt: Any  # str or chat messages
    responses: list  # str or chat messages, in load order
    rewards: list[float]
    extras: list[dict] = field(default_factory=list)  # other columns of each row (for reward logs)


@dataclass
class GroupReport:
    prompts_seen: int = 0
    groups_made: int = 0
    responses_in_groups: int = 0
    too_small: int = 0  # fewer than min_size responses
    zero_spread: int = 0  # every reward equal: all advantages are zero

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def format(self) -> str:
        return "\n".join([
            f"prompts seen: {self.prompts_seen}",
            f"groups made: {self.groups_made} ({self.responses_in_groups} responses)",
            f"left out, fewer responses than min_size: {self.too_small}",
            f"left out, all rewards equal: {self.zero_spread}",
        ])


def build_groups(traces: Sequence[Trace], *, min_size: int = 2) -> tuple[list[Group], GroupReport]:
    """One group per prompt, in first-appearance order; too-small and zero-spread groups counted."""
    if min_size < 1:
        raise UserError(f"min_group_size must be >= 1, got {min_size}")
    report = GroupReport()
    groups: list[Group] = []
    for members in group_by_prompt(traces).values():
        report.prompts_seen += 1
        rewards = [t.reward for t in members]
        if len(members) < min_size:
            report.too_small += 1
        elif max(rewards) == min(rewards):
            report.zero_spread += 1
        else:
            groups.append(Group(members[0].prompt, [t.response for t in members], rewards,
                                [t.extra for t in members]))
            report.groups_made += 1
            report.responses_in_groups += len(members)
    return groups, report
