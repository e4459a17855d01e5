"""The log-prob layouts (aligned and left-packed on the HF module, left-packed on the lean decoder)
give the same numbers; the cost model picks between the HF ones."""
import torch

from preftune.model import llama as D, logps as L
from tests.algorithms.test_grpo_step import synthetic_rollout


def _run(model, ro):
    with torch.no_grad():
        return L.completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                  with_entropy=True)


def test_packed_and_aligned_layouts_agree(model, tokenizer, monkeypatch):
    model.eval()
    ro = synthetic_rollout(tokenizer)
    assert D.supported(model)
    monkeypatch.setattr(L, "shared_pays", lambda *a: False)  # the per-row layouts (these rows share prompts)
    lean = _run(model, ro)  # the lean decoder replays this model: it takes the per-row pass
    monkeypatch.setattr(D, "supported", lambda m: False)  # the HF module's forward
    monkeypatch.setattr(L, "prefer_packed", lambda *a: True)
    packed = _run(model, ro)
    monkeypatch.setattr(L, "prefer_packed", lambda *a: False)
    aligned = _run(model, ro)
    mask = ro.completion_mask.bool()
    for a, b, c in zip(packed, aligned, lean):
        torch.testing.assert_close(a[mask], b[mask], rtol=0, atol=2e-5)
        torch.testing.assert_close(c[mask], b[mask], rtol=0, atol=2e-5)


def test_packing_shrinks_the_width_of_uneven_rows(tokenizer):
    ro = synthetic_rollout(tokenizer)
    short = ro.completion_mask.clone()
    short[:, 2:] = 0  # every completion at most 2 tokens: the longest row is now shorter than P+T
    width = L.Rows.read(ro.prompt_ids, ro.prompt_mask, short).width
    ids, mask, start = L.pack_left(ro.prompt_ids, ro.prompt_mask, ro.completion_ids, short, width)
    assert ids.size(1) < ro.prompt_ids.size(1) + ro.completion_ids.size(1)
    assert torch.equal(start, ro.prompt_mask.sum(1))
    for i in range(ids.size(0)):  # each row keeps its tokens, in order, then padding
        want = torch.cat([ro.prompt_ids[i][ro.prompt_mask[i].bool()], ro.completion_ids[i][short[i].bool()]])
        assert torch.equal(ids[i, :len(want)], want) and mask[i, :len(want)].all() and not mask[i, len(want):].any()


def test_cost_model_weighs_width_against_vocabulary():
    cfg = type("C", (), {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 256})()
    cfg.vocab_size = 10**7  # the lm_head dominates: keep the narrow logits (aligned)
    assert not L.prefer_packed(cfg, width=30, keep=25, P=30, T=10)
    cfg.vocab_size = 100  # the decoder dominates: the narrower sequence wins (packed)
    assert L.prefer_packed(cfg, width=30, keep=25, P=30, T=10)
    assert L.prefer_packed(None, width=30, keep=11, P=30, T=10) and not L.prefer_packed(None, 30, 12, 30, 10)


def test_lean_rows_train_as_the_module(model, tokenizer, monkeypatch):
    """With grad in float32 (the hand-written RMSNorm and RoPE backward passes): the lean per-row
    pass gives the HF module's log-probs and gradients, to float32 rounding."""
    ro = synthetic_rollout(tokenizer)
    monkeypatch.setattr(L, "shared_pays", lambda *a: False)
    calls = []
    lean_hidden = L._lean_hidden
    monkeypatch.setattr(L, "_lean_hidden", lambda *a: calls.append(1) or lean_hidden(*a))
    out = []
    for supported in (True, False):
        with monkeypatch.context() as m:
            if not supported:
                m.setattr(D, "supported", lambda model: False)
            model.zero_grad(set_to_none=True)
            lp, _ = L.completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask)
            (lp * ro.completion_mask).sum().backward()
            out.append((lp.detach(), torch.cat([p.grad.flatten() for p in model.parameters()])))
    model.zero_grad(set_to_none=True)
    assert calls == [1]  # the first pass was the lean one, the second the module's
    mask = ro.completion_mask.bool()
    torch.testing.assert_close(out[0][0][mask], out[1][0][mask], rtol=0, atol=2e-5)
    scale = out[1][1].abs().max().item()
    assert scale > 0
    torch.testing.assert_close(out[0][1], out[1][1], rtol=0, atol=1e-5 * scale)


def test_hf_mask_is_built_on_the_device_not_read():
    """The mask handed to the HF module: none without left padding (plain causal attention), else
    SDPA's 4-D boolean mask by hand (real keys up to the query's column, and the query itself),
    or the 2-D mask for other attention kernels."""
    sdpa = type("M", (), {"config": type("C", (), {"_attn_implementation": "sdpa"})()})()
    eager = type("M", (), {"config": type("C", (), {"_attn_implementation": "eager"})()})()
    keys = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])  # row 0 left-padded; row 1 ends in a padded completion token
    assert L._hf_mask(sdpa, keys, 4, left_padded=False) is None
    assert L._hf_mask(eager, keys, 4, left_padded=True) is keys
    got = L._hf_mask(sdpa, keys, 2, left_padded=True)  # the last 2 columns query
    want = torch.tensor([[[[0, 1, 1, 0], [0, 1, 1, 1]]], [[[1, 1, 1, 0], [1, 1, 1, 1]]]], dtype=torch.bool)
    assert got.shape == (2, 1, 2, 4) and torch.equal(got, want)


def test_sliding_window_models_keep_their_window():
    """A sliding-window model takes the HF module's forward (the lean decoder refuses it), and HF hands
    a 4-D mask to every layer unchanged: it gets the 2-D mask, so left-padded rows keep their window."""
    from transformers import MistralConfig, MistralForCausalLM

    from preftune.data.tensors import positions_from_mask

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=3, attn_implementation="sdpa")
    model = MistralForCausalLM(cfg).eval()
    assert not D.supported(model) and not L._full_attention(model.config)
    p_ids, c_ids = torch.randint(3, 64, (2, 6)), torch.randint(3, 64, (2, 5))
    p_mask, c_mask = torch.ones(2, 6, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    p_mask[1, :2] = 0  # row 1 left-padded
    with torch.no_grad():
        got, _ = L.completion_logps(model, p_ids, p_mask, c_ids, c_mask)
        ids, attn = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions_from_mask(attn)).logits.float()
    want, _ = L.token_logps(logits[:, p_ids.size(1) - 1:-1], c_ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    full = type("C", (), {"layer_types": ["full_attention"] * 2})()
    assert L._full_attention(full) and L._full_attention(type("C", (), {})())
    assert not L._full_attention(type("C", (), {"layer_types": ["full_attention", "sliding_attention"]})())


def test_rows_of_token_lists_equal_rows_read_from_the_padded_tensors():
    """DPO and SFT build `Rows` from their token lists (no host read): the same as reading the padded
    rows they run (pad ids inside prompts and responses, empty responses, repeated prompts); and a
    batch with no rows (a rank whose round drew none) reads as empty."""
    from preftune.data.tensors import left_pad, right_pad

    g = torch.Generator().manual_seed(3)
    prompts, comps = [], []
    for i in range(12):
        p = torch.randint(0, 6, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g).tolist()
        for _ in range(1 + i % 3):  # runs of 1-3 rows with one prompt
            prompts.append(p)
            comps.append(torch.randint(0, 6, (int(torch.randint(0, 4, (1,), generator=g)),), generator=g).tolist())
    p_ids, p_mask = left_pad(prompts, pad_id=0)
    _, c_mask = right_pad(comps, pad_id=0)
    assert L.Rows.of(prompts, [len(c) for c in comps]) == L.Rows.read(p_ids, p_mask, c_mask)
    empty = torch.zeros((0, 1), dtype=torch.long)
    assert L.Rows.read(empty, empty, empty) == L.Rows([], [], [])
