"""Supervised fine-tuning loss on completion tokens only (pure function).

    L = -(1/N) Σ_i Σ_t m_it log π(y_it | x_i, y_i,<t)

with m the completion mask (prompt and padding tokens are 0) and N the number of completion tokens
in the whole optimiser batch (`num_items`), not in the micro-batch: micro-batch losses then simply
add up to the full-batch loss and gradient. This is the token-mean negative log-likelihood of TRL's
SFTTrainer with `completion_only_loss` and `num_items_in_batch` (the loss of supervised instruction
tuning, e.g. Ouyang et al. 2022, arXiv:2203.02155; on filtered own samples it is rejection-sampling
fine-tuning, Yuan et al. 2023, arXiv:2308.01825).
"""
from __future__ import annotations

import torch


def sft_loss(logps: torch.Tensor, mask: torch.Tensor, num_items: int | float) -> torch.Tensor:
    """logps, mask: (B, T) per-token log-probs and completion mask (any equal shapes, e.g. flat
    (N,)); num_items: completion tokens of the optimiser batch (>= 1). Returns a scalar."""
    if num_items <= 0:
        raise ValueError("num_items must be positive")
    return -(logps * mask).sum() / num_items
