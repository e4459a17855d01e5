"""The routers' load-balancing loss: by hand, and against transformers' function (which TRL 1.16
adds with router_aux_loss_coef) in float64."""
from __future__ import annotations

import math

import pytest
import torch

from preftune.losses.moe import load_balancing_loss, router_counts


def _logits(*probs):
    return torch.log(torch.tensor(probs, dtype=torch.float64))


@pytest.mark.parametrize("weights, want", [
    ([1.0, 1.0], 2 * 0.7),  # both tokens pick expert 0: f = (1, 0), P = (0.7, 0.3)
    ([3.0, 1.0], 2 * 0.75),  # the first stands for 3 tokens: P = (0.75, 0.25)
    ([1.0, 0.0], 2 * 0.8),  # a padding token counts for nothing
])
def test_by_hand(weights, want):
    loss = load_balancing_loss([_logits([0.8, 0.2], [0.6, 0.4])], [torch.tensor(weights)], top_k=1)
    assert math.isclose(float(loss), want, rel_tol=1e-12)


def test_even_load_and_uniform_router_give_k():
    logits = torch.zeros(8, 4, dtype=torch.float64)  # ties: topk picks the first k, so spread them
    logits += torch.eye(4, dtype=torch.float64).repeat(2, 1) * 1e-9
    loss = load_balancing_loss([logits], [torch.ones(8)], top_k=1)
    assert math.isclose(float(loss), 1.0, rel_tol=1e-6)


def test_equals_transformers_with_and_without_padding():
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    g = torch.Generator().manual_seed(0)
    B, L, E, k, layers = 3, 5, 6, 2, 2
    logits = [torch.randn(B * L, E, generator=g, dtype=torch.float64) for _ in range(layers)]
    mask = (torch.rand(B, L, generator=g) > 0.3).long()
    for m in (None, mask):
        want = load_balancing_loss_func(tuple(logits), E, k, m)
        w = torch.ones(B * L) if m is None else m.reshape(-1).double()
        got = load_balancing_loss(logits, [w] * layers, k)
        torch.testing.assert_close(got, want.to(got.dtype), rtol=1e-6, atol=0)


def test_gradient_reaches_the_router_through_the_probabilities_only():
    logits = _logits([0.8, 0.2], [0.6, 0.4]).requires_grad_()
    load_balancing_loss([logits], [torch.ones(2)], top_k=1).backward()
    # L = 2 (p_00 + p_10) / 2 with f = (1, 0): dL/dz = p_0 (1 - p_0) for z_0, the negative for z_1
    want = torch.tensor([[0.16, -0.16], [0.24, -0.24]], dtype=torch.float64)
    torch.testing.assert_close(logits.grad, want, rtol=0, atol=1e-12)


def test_counts_entropy_and_total():
    layer0, layer1 = _logits([0.8, 0.2], [0.6, 0.4]), _logits([0.5, 0.5], [0.1, 0.9])
    w = torch.tensor([2.0, 1.0])
    counts, entropy, total = router_counts([layer0, layer1], [w, w], top_k=1, layers=2)
    assert counts.tolist() == [[3.0, 0.0], [2.0, 1.0]] and float(total) == 6.0

    def h(*p):
        return -sum(x * math.log(x) for x in p)

    want = 2 * h(0.8, 0.2) + h(0.6, 0.4) + 2 * h(0.5, 0.5) + h(0.1, 0.9)
    assert math.isclose(float(entropy), want, rel_tol=1e-6)
