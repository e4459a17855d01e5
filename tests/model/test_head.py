"""The chunked vocabulary projection (`model/head.py`): the log-probs, entropy and gradients of the
plain (K, V) computation, without (K, V) logits saved for the backward."""
from __future__ import annotations

import pytest
import torch

from preftune.model import head as H
from preftune.model.head import token_logps
from preftune.model.llama import Llama
from preftune.model.logps import completion_logps


def _plain(hidden, weight, targets, temperature):
    logits = (hidden @ weight.t()) / temperature
    return token_logps(logits, targets, with_entropy=True)


def _setup(dtype=torch.float64, K=37, Hd=8, V=50, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(K, Hd, generator=g, dtype=dtype, requires_grad=True)
    head = torch.nn.Linear(Hd, V, bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, Hd, generator=g, dtype=dtype))
    targets = torch.randint(0, V, (K,), generator=g)
    return hidden, head, targets


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_equals_plain_in_float64(monkeypatch, temperature):
    hidden, head, targets = _setup()
    w = torch.linspace(-1, 2, targets.numel(), dtype=torch.float64)  # a different weight per token
    want, want_ent = _plain(hidden, head.weight, targets, temperature)
    (want * w).sum().backward()
    want_dh, want_dw = hidden.grad.clone(), head.weight.grad.clone()
    hidden.grad = head.weight.grad = None
    monkeypatch.setattr(H, "CHUNK_ELEMENTS", 50 * 4)  # 4 rows per chunk: 10 chunks, the last one short
    got, ent = H.head_logps(hidden, head, targets, temperature=temperature, with_entropy=True)
    (got * w).sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, want_ent, rtol=0, atol=1e-12)
    torch.testing.assert_close(hidden.grad, want_dh, rtol=0, atol=1e-12)
    torch.testing.assert_close(head.weight.grad, want_dw, rtol=0, atol=1e-12)
    assert not ent.requires_grad


def test_no_logits_are_saved_for_the_backward(monkeypatch):
    """The point of chunking: nothing of (K, V) size waits for the backward (the plain path saves it)."""
    hidden, head, targets = _setup(K=64, V=200)
    sizes = []

    def pack(t):
        sizes.append(t.numel())
        return t

    for chunk, limit in ((1 << 30, None), (200 * 8, 64 * 200)):
        monkeypatch.setattr(H, "CHUNK_ELEMENTS", chunk)
        sizes.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            H.head_logps(hidden, head, targets)[0].sum().backward()
        if limit is None:
            assert max(sizes) >= 64 * 200  # unchunked: the logits are saved
        else:
            assert max(sizes) < limit / 4  # chunked: hidden (64 x 8), weight (200 x 8), targets, lse


def test_chunked_under_bf16_autocast_matches_plain(monkeypatch):
    hidden, head, targets = _setup(dtype=torch.float32, K=24, Hd=16, V=64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, _ = H.head_logps(hidden, head, targets)
        want.sum().backward()
        want_dh = hidden.grad.clone()
        hidden.grad = None
        monkeypatch.setattr(H, "CHUNK_ELEMENTS", 64 * 5)
        got, _ = H.head_logps(hidden, head, targets)
        got.sum().backward()
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)  # the same bf16 logits, upcast
    torch.testing.assert_close(hidden.grad, want_dh, rtol=2e-2, atol=2e-2)  # bf16 matmuls in the backward


def test_completion_logps_chunked_equals_plain(monkeypatch):
    """Through the own module's log-prob pass (rows repeat their prompt), float64."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen2", vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = Llama.of(AutoModelForCausalLM.from_config(cfg, dtype=torch.float64))
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(2, 97, (2, 6), generator=g).repeat_interleave(3, 0)  # (6, 6): 2 prompts x G=3
    p_mask = torch.ones_like(prompt)
    p_mask[:3, :2] = 0
    comp = torch.randint(2, 97, (6, 5), generator=g)
    c_mask = torch.ones_like(comp)
    c_mask[1, 3:] = 0

    def run():
        model.zero_grad(set_to_none=True)
        lp, ent = completion_logps(model, prompt, p_mask, comp, c_mask, temperature=0.9, with_entropy=True)
        (lp * c_mask).sum().backward()
        return lp.detach(), ent, torch.cat([p.grad.flatten() for p in model.parameters()])

    want = run()
    monkeypatch.setattr(H, "CHUNK_ELEMENTS", 97 * 3)
    got = run()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_token_stats_chunked_equal_the_formulas(monkeypatch):
    """`stats`: entropy, mean logit, top-1 and log Σ p² per position, the same chunked as plain."""
    hidden, head, targets = _setup()
    logits = hidden.detach() @ head.weight.detach().t()  # (K, V)
    targets = torch.where(torch.arange(len(targets)) < 10, logits.argmax(-1), targets)  # 10 top-1 targets
    p = logits.softmax(-1)
    expected = torch.stack([-(p * p.log()).sum(-1), logits.mean(-1), (logits.argmax(-1) == targets).double(),
                            (p * p).sum(-1).log()], -1)  # (K, 4)
    _, plain = H.head_logps(hidden, head, targets, stats=True)
    monkeypatch.setattr(H, "CHUNK_ELEMENTS", 7 * 50)  # 7 rows a chunk
    logps, chunked = H.head_logps(hidden, head, targets, stats=True)
    for got in (plain, chunked):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert 0 < expected[:, 2].sum() < len(targets)  # some targets are the argmax, some not
    logps.sum().backward()  # the stats carry no gradient; the log-probs still do
    assert hidden.grad is not None and not chunked.requires_grad
