"""Tool tokens are out of every GRPO loss (`Rollout.loss_mask`): a completion with tool results
inside it gives the loss, KL and gradients of the same completion with those tokens cut out, for
every loss_type and both importance levels (GSPO's sequence ratio too); the stop tokens count."""
from __future__ import annotations

import itertools

import pytest
import torch

from preftune.losses import grpo_loss
from preftune.losses.grpo import LOSS_TYPES, batch_normaliser
from preftune.rollout.sampler import Rollout


@pytest.mark.parametrize("loss_type, level", list(itertools.product(LOSS_TYPES, ("token", "sequence"))))
def test_tool_tokens_are_out_of_every_loss(loss_type, level):
    g = torch.Generator().manual_seed(0)
    B, T, tool = 4, 9, slice(3, 6)  # each row: 3 sampled, 3 tool tokens, 3 sampled (the last a stop token)
    logps = (torch.rand(B, T, generator=g, dtype=torch.float64) - 2.0).requires_grad_()
    old = logps.detach() + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    ref = logps.detach() + 0.1 * torch.randn(B, T, generator=g, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5, 0.3, -1.2], dtype=torch.float64)
    tool_mask = torch.ones(B, T, dtype=torch.long)
    tool_mask[:, tool] = 0
    ro = Rollout(torch.ones(B, 1, dtype=torch.long), torch.ones(B, 1, dtype=torch.long),
                 torch.zeros(B, T, dtype=torch.long), torch.ones(B, T, dtype=torch.long),
                 torch.zeros(B, dtype=torch.bool), tool_mask=tool_mask)
    keep = torch.tensor([i for i in range(T) if not tool.start <= i < tool.stop])
    kw = dict(loss_type=loss_type, beta=0.04, epsilon=0.2, epsilon_high=5.0 if loss_type == "cispo" else 0.28,
              importance_sampling_level=level, max_completion_length=T - 3)
    mask = ro.loss_mask().double()
    n = batch_normaliser(loss_type, batch_seqs=B, batch_tokens=float(mask.sum()), max_completion_length=T - 3)
    loss, m = grpo_loss(logps, old, ref, adv, mask, normaliser=n, **kw)
    short = logps[:, keep].detach().requires_grad_()
    want, wm = grpo_loss(short, old[:, keep], ref[:, keep], adv, torch.ones(B, len(keep), dtype=torch.float64),
                         normaliser=n, **kw)
    loss.backward()
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(m["kl"], wm["kl"])
    assert (logps.grad[:, tool] == 0).all()  # no gradient reaches a tool token
    torch.testing.assert_close(logps.grad[:, keep], short.grad)
    assert (logps.grad[:, -1] != 0).all()  # the stop token trains
