"""SFT loss: hand-worked value, equality with token-mean cross-entropy (TRL's completion-only loss), and
exact accumulation over micro-batches with the batch-level normaliser."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from preftune.losses import sft_loss


def test_hand_worked_value():
    logps = torch.tensor([[math.log(0.5), math.log(0.25), -7.0], [math.log(0.1), -3.0, -3.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])  # masked tokens (prompt, padding) do not count
    expected = -(math.log(0.5) + math.log(0.25) + math.log(0.1)) / 3
    assert sft_loss(logps, mask, 3).item() == pytest.approx(expected, rel=1e-6)
    assert sft_loss(logps, mask, 6).item() == pytest.approx(expected / 2, rel=1e-6)  # normaliser = the step's tokens


def test_equals_token_mean_cross_entropy_with_ignored_labels():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64)  # (B, T, V)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    mask = (torch.rand(3, 5, generator=g) > 0.3).double()
    logps = logits.log_softmax(-1).gather(-1, targets[..., None]).squeeze(-1)
    labels = targets.masked_fill(mask == 0, -100)  # HF / TRL: -100 = no loss
    ce = F.cross_entropy(logits.reshape(-1, 11), labels.reshape(-1), ignore_index=-100)
    torch.testing.assert_close(sft_loss(logps, mask, int(mask.sum())), ce, rtol=0, atol=1e-12)


def test_micro_batches_add_up_to_the_full_batch():
    g = torch.Generator().manual_seed(1)
    logps = -torch.rand(6, 4, generator=g, dtype=torch.float64).requires_grad_()
    mask = (torch.rand(6, 4, generator=g) > 0.4).double()
    n = int(mask.sum())
    full = sft_loss(logps, mask, n)
    (g_full,) = torch.autograd.grad(full, logps)
    parts = [sft_loss(logps[s], mask[s], n) for s in (slice(0, 1), slice(1, 4), slice(4, 6))]
    (g_parts,) = torch.autograd.grad(sum(parts), logps)
    torch.testing.assert_close(sum(parts), full, rtol=0, atol=1e-14)
    torch.testing.assert_close(g_parts, g_full, rtol=0, atol=1e-14)


def test_rejects_an_empty_batch():
    with pytest.raises(ValueError):
        sft_loss(torch.zeros(2), torch.zeros(2), 0)
