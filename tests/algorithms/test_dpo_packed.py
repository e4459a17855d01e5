"""Tree-packed DPO pairs (`packed_sequence_logps`: [prompt | chosen | rejected] per pair, pairs packed
into rows) give the sums, counts and gradients of the bucketed Hugging Face path and of one plain
forward per sequence (float64); `pack_rows` and `tree_plan` on their own."""
from __future__ import annotations

import pytest
import torch

from preftune.algorithms import dpo
from preftune.algorithms.dpo import EncodedPair, pack_rows, packed_sequence_logps, sequence_logps, tree_plan
from preftune.model import llama as D
from tests.conftest import MODEL_DIR

PAD = 0


@pytest.fixture(scope="module")
def model64():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float64).eval()


def _pairs(shape: list[tuple[int, int, int]], seed: int = 0) -> list[EncodedPair]:
    g = torch.Generator().manual_seed(seed)
    toks = lambda n: torch.randint(3, 259, (n,), generator=g).tolist()  # noqa: E731
    return [EncodedPair(toks(p), toks(c), toks(r)) for p, c, r in shape]


# (prompt, chosen, rejected) lengths: different prompts, an empty rejected, and short pairs that
# share a row with longer ones (width = the longest pair, 26)
SHAPES = [(12, 8, 6), (3, 2, 1), (5, 4, 0), (4, 3, 3), (7, 5, 6), (1, 1, 1)]


def _direct(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """One plain forward per (prompt + response): the sum of log p(response tokens), and the length."""
    sums, counts = [], []
    for k in (0, 1):
        for e in batch:
            resp = e.chosen if k == 0 else e.rejected
            seq = torch.tensor([e.prompt + resp])
            logp = model(input_ids=seq).logits[0, len(e.prompt) - 1:-1].log_softmax(-1)  # (|resp|, V)
            sums.append(logp.gather(-1, torch.tensor(resp, dtype=torch.long)[:, None]).sum())
            counts.append(len(resp))
    return torch.stack(sums), torch.tensor(counts)


def _grads(model, sums, w) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    (sums * w).sum().backward()
    out = torch.cat([p.grad.flatten() for p in model.parameters()])
    model.zero_grad(set_to_none=True)
    return out


def test_pack_rows_share_rows_here():
    rows, width = pack_rows([sum(s) for s in SHAPES])
    assert width == 26 and any(len(r) > 1 for r in rows)


@pytest.mark.parametrize("shapes", [SHAPES, SHAPES[:1], [(6, 3, 0), (6, 0, 3), (2, 5, 5)]],
                         ids=["shared_rows", "one_pair", "empty_responses"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused_weights", "module_weights"])
def test_packed_equals_bucketed_and_plain_forward(model64, monkeypatch, shapes, fused):
    batch = _pairs(shapes)
    n = 2 * len(batch)
    w = torch.randn(n, generator=torch.Generator().manual_seed(1), dtype=torch.float64)

    # training takes the module's own q/k/v and gate/up matrices; the fused layout (decoding's) gives
    # the same sums and gradients
    lean = D.Lean(model64, decoding=fused)
    assert isinstance(lean.layers[0]["qkv"], torch.Tensor) == fused
    packed, p_counts = packed_sequence_logps(lean, batch, PAD, "cpu")
    g_packed = _grads(model64, packed, w)
    with monkeypatch.context() as mp:
        mp.setattr(D, "supported", lambda model: False)  # sequence_logps takes the bucketed HF path
        bucketed, b_counts = sequence_logps(model64, batch, PAD, "cpu")
    g_bucketed = _grads(model64, bucketed, w)
    direct, d_counts = _direct(model64, batch)
    g_direct = _grads(model64, direct, w)

    assert packed.shape == bucketed.shape == (n,)
    assert p_counts.tolist() == b_counts.tolist() == d_counts.tolist()  # chosen lengths, then rejected
    # float64 model, float64 logits on both paths (test_packed_keeps_the_model_dtype)
    torch.testing.assert_close(packed, bucketed, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(bucketed, direct, rtol=1e-9, atol=1e-9)
    empty = d_counts == 0
    assert (packed[empty] == 0).all() and (bucketed[empty] == 0).all()
    scale = g_bucketed.abs().max().item()
    assert scale > 0
    torch.testing.assert_close(g_packed, g_bucketed, rtol=0, atol=1e-6 * scale)
    # HF's RMSNorm runs in float32 even for a float64 model: layouts agree to float32 rounding
    torch.testing.assert_close(g_bucketed, g_direct, rtol=0, atol=1e-6 * scale)


def test_packed_keeps_the_model_dtype(model64, monkeypatch):
    """A float64 model gets float64 log-probs, as on the bucketed path (`logps.upcast_logits`: "float64 stays
    float64"), so the two paths agree to float64 rounding.

    Fails on 5088763: preftune/train/dpo.py:149 (`lean.logits(...).float()`) casts the logits to
    float32. With that `.float()` removed the two paths agree to ~3e-16 relative (even with HF's
    float32 RMSNorm); with it, to ~1e-7."""
    batch = _pairs(SHAPES)
    packed, _ = packed_sequence_logps(D.Lean.of(model64), batch, PAD, "cpu")
    with monkeypatch.context() as mp:
        mp.setattr(D, "supported", lambda model: False)
        bucketed, _ = sequence_logps(model64, batch, PAD, "cpu")
    assert packed.dtype == bucketed.dtype == torch.float64, f"packed {packed.dtype}, bucketed {bucketed.dtype}"
    torch.testing.assert_close(packed, bucketed, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("pays", [True, False])
def test_sequence_logps_takes_the_packed_path_when_it_pays(model64, monkeypatch, pays):
    calls = []
    real = dpo.packed_sequence_logps
    monkeypatch.setattr(dpo, "packed_sequence_logps", lambda *a: calls.append(a) or real(*a))
    batch = _pairs(SHAPES)
    plan = pack_rows([len(e.prompt) + len(e.chosen) + len(e.rejected) for e in batch], 40)
    monkeypatch.setattr(dpo, "tree_plan", lambda config, batch: plan if pays else None)
    with torch.no_grad():
        sums, counts = sequence_logps(model64, batch, PAD, "cpu")
    assert len(calls) == (1 if pays else 0)
    assert not calls or calls[0][-1] == plan  # the plan that was costed is the one run
    assert counts.tolist() == [len(e.chosen) for e in batch] + [len(e.rejected) for e in batch]
    # a model the lean decoder refuses never takes it, whatever it would cost
    calls.clear()
    monkeypatch.setattr(model64, "preftune_lean", False, raising=False)
    with torch.no_grad():
        again, _ = sequence_logps(model64, batch, PAD, "cpu")
    assert not calls
    torch.testing.assert_close(sums.double(), again, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("factor", [2, 4])
def test_wider_rows_give_the_same_logps(model64, factor):
    """Rows several pairs wide (a `tree_plan` choice) hold more pairs per row: same numbers."""
    batch = _pairs(SHAPES + [(2, 3, 4), (9, 1, 2)], seed=3)
    lengths = [len(e.prompt) + len(e.chosen) + len(e.rejected) for e in batch]
    lean = D.Lean.of(model64)
    with torch.no_grad():
        narrow, c1 = packed_sequence_logps(lean, batch, PAD, "cpu")
        plan = pack_rows(lengths, factor * max(lengths))
        assert len(plan[0]) < len(pack_rows(lengths)[0])
        wide, c2 = packed_sequence_logps(lean, batch, PAD, "cpu", plan)
    assert c1.tolist() == c2.tolist()
    torch.testing.assert_close(wide, narrow, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("lengths", [[26, 6, 9, 10, 18, 3], [5], [4, 4, 4, 4], [10, 1, 9, 2, 8, 3, 7, 4, 6, 5],
                                     list(range(1, 30)), [7, 0, 7, 0]])
@pytest.mark.parametrize("factor", [None, 1, 3])
def test_pack_rows_invariants(lengths, factor):
    rows, width = pack_rows(lengths) if factor is None else pack_rows(lengths, factor * max(lengths))
    assert width == max(lengths) * (factor or 1)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))  # every index exactly once
    assert all(r and sum(lengths[i] for i in r) <= width for r in rows)
    assert len(rows) >= -(-sum(lengths) // width)  # no packing beats the total over the width


def test_pack_rows_first_fit_decreasing():
    # by hand, width 9, longest first: 9 (index 2) fills row 0; 7 (4) opens row 1 (room 2); 5 (0) opens
    # row 2 (room 4); 3 (1) first fits row 2 (room 1); 2 (3) first fits row 1 (room 0); 1 (5) fits row 2
    rows, width = pack_rows([5, 3, 9, 2, 7, 1])
    assert width == 9
    assert rows == [[2], [4, 3], [0, 1, 5]]


def _config():
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen2", vocab_size=32000, hidden_size=256, num_hidden_layers=4,
                                intermediate_size=768, num_attention_heads=4, num_key_value_heads=2)


def test_tree_pays_for_a_long_shared_prompt_not_for_long_responses():
    cfg = _config()
    shared = [EncodedPair([5] * 300, [6] * 8, [7] * 8) for _ in range(4)]
    assert tree_plan(cfg, shared) is not None
    long_responses = [EncodedPair([5] * 10, [6] * 200, [7] * 200) for _ in range(4)]
    assert tree_plan(cfg, long_responses) is None
    rows, width = tree_plan(cfg, shared)
    assert sorted(i for r in rows for i in r) == [0, 1, 2, 3] and width >= 316


def test_packed_pairs_under_bf16_autocast_match_the_module():
    """`model.dtype: bfloat16` (float32 masters under bf16 autocast): the packed path enters the
    autocast as the bucketed path does, returns float32 sums, and agrees with one plain forward per
    sequence under the same autocast to bf16 precision."""
    from transformers import AutoModelForCausalLM

    from preftune.model.load import autocast

    model = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32).eval()
    model.preftune_autocast = torch.bfloat16
    batch = _pairs([(12, 3, 2), (10, 2, 3), (9, 3, 3), (11, 1, 2), (6, 2, 0)], seed=4)  # prompts worth sharing
    assert D.supported(model) and tree_plan(model.config, batch) is not None
    with torch.no_grad():
        sums, counts = sequence_logps(model, batch, PAD, torch.device("cpu"))
        with autocast(model):
            want, want_counts = _direct(model, batch)
    assert sums.dtype == torch.float32
    assert torch.equal(counts, want_counts)
    torch.testing.assert_close(sums, want.float(), rtol=3e-2, atol=0.1)
    del model.preftune_autocast
    with torch.no_grad():
        full, _ = sequence_logps(model, batch, PAD, torch.device("cpu"))
    assert (sums - full).abs().max() > 1e-4  # the autocast was on: bf16 matmuls moved the sums
