"""Token lists to padded tensors, and positions from a mask: shared by data, rollouts and the model
passes."""
from __future__ import annotations

import torch


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: (B, L) mask -> (B, L) positions."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows aligned on the right (prompts): (B, P) ids and mask, padding before each row."""
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, P)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows aligned on the left (completions): (B, T) ids and mask, padding after each row (width >=
    1)."""
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, T)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask


def read_once(rows: list[dict]) -> list[dict[str, float]]:
    """Dicts of 0-dim tensors (one per micro-batch, the same keys) as python floats, in one host
    sync: reading each micro-batch's as it ends would stall the device between passes."""
    if not rows:
        return []
    names = list(rows[0])
    values = torch.stack(
        [torch.stack([r[k].to(torch.float64) for k in names]) for r in rows]
    ).tolist()
    return [dict(zip(names, v)) for v in values]
