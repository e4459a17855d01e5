"""The own module's hand-written RMSNorm and RoPE backward passes: finite differences, and a
float32 training pass against the Hugging Face module's, also under bf16 autocast."""
from __future__ import annotations

import pytest
import torch

from preftune.model import llama as D, ops
from preftune.model.families import own_class
from tests.model.test_llama import ARCHS, VOCAB, grads, tiny

Llama = D.Llama


def test_hand_written_backward_passes_are_the_gradients():
    """`_RMSNorm` and `_Rope` against finite differences (float64, any dtype they are given), and their
    forward against the plain formulas."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 3, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)  # (B, L, h, d)
    w = torch.randn(8, generator=g, dtype=torch.float64, requires_grad=True)
    cos, sin = torch.randn(2, 2, 3, 1, 8, generator=g, dtype=torch.float64)  # (B, L, 1, d), halves differ
    assert torch.autograd.gradcheck(lambda x, w: ops._RMSNorm.apply(x, w, 1e-6), (x, w))
    assert torch.autograd.gradcheck(lambda x: ops._Rope.apply(x, cos, sin), (x,))
    with torch.no_grad():
        x1, x2 = x.chunk(2, -1)
        torch.testing.assert_close(ops._Rope.apply(x, cos, sin), x * cos + torch.cat([-x2, x1], -1) * sin)
        norm = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        torch.testing.assert_close(ops._RMSNorm.apply(x, w, 1e-6), norm, rtol=0, atol=0)  # the same ops


def _case(arch: str, seed: int):
    """A float32 tiny model of `arch` (HF's and the own one), ids (2, 11), positions and logit
    weights for a scalar loss."""
    model_type, kw = ARCHS[arch]
    model = tiny(model_type, dtype=torch.float32, **kw)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, 11), generator=g)
    return model, own_class(model.config).of(model), ids, torch.arange(11)[None].expand(2, 11), torch.randn(2, 11, VOCAB, generator=g)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama-bias", "glm4"])
def test_bf16_autocast_training_pass_is_the_modules(arch):
    """Under bf16 autocast (float32 masters, `model.dtype: bfloat16`) `_Rope` meets bf16 q/k and
    float32 cos/sin, and `_RMSNorm` the float32 residual stream: logits and gradients equal HF's to
    bf16 rounding."""
    model, own, ids, pos, w = _case(arch, seed=7)
    out = {}
    for path in ("hf", "own"):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if path == "hf":
                logits = model(input_ids=ids, position_ids=pos).logits
            else:
                logits = own.logits(own.hidden(ids, pos))
        (logits.float() * w).sum().backward()
        out[path] = logits.float().detach(), grads(model if path == "hf" else own)
    (want, want_grads), (got, got_grads) = out["hf"], out["own"]
    torch.testing.assert_close(got, want, rtol=0, atol=2e-2 * want.abs().max().item())
    for name, gw in want_grads.items():
        assert got_grads[name].dtype == torch.float32
        torch.testing.assert_close(got_grads[name], gw, rtol=0, atol=3e-2 * gw.abs().max().item(), msg=name)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama-bias"])
def test_float32_training_pass_equals_hf(arch):
    """In float32 the own module takes the hand-written RMSNorm backward (HF computes RMSNorm in
    float32, so float64 runs never reach it): the same logits, and gradients to float32 rounding."""
    model, own, ids, pos, w = _case(arch, seed=6)
    want = model(input_ids=ids, position_ids=pos).logits
    (want * w).sum().backward()
    want_grads = grads(model)
    calls = []
    apply = ops._RMSNorm.apply
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ops._RMSNorm, "apply", lambda *a: calls.append(1) or apply(*a))
        got = own.logits(own.hidden(ids, pos))
    (got * w).sum().backward()
    got_grads = grads(own)
    layers = len(own.model.layers)
    assert len(calls) == 2 * layers + 1 + (2 * layers if arch == "qwen3" else 0)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for name, gw in want_grads.items():
        torch.testing.assert_close(got_grads[name], gw, rtol=0, atol=1e-5 * gw.abs().max().item(), msg=name)
