"""The KV-cache sampler: shapes, EOS masking, truncation, parity with HF generate, filters, concat/select."""
from __future__ import annotations

import pytest
import torch

from preftune.data.tensors import left_pad, positions_from_mask

from preftune.model.head import filter_logits
from preftune.rollout.sampler import Rollout, concat, sample, select

# Prompts of different lengths, so the batch is left-padded.
PROMPTS = ["12+7=", "3+4=", "19+19=", "0+0=", "5+11="]


def _encode(tokenizer, prompts=PROMPTS):
    return left_pad([tokenizer(p).input_ids for p in prompts], tokenizer.pad_token_id)


def _sample(model, tokenizer, prompts=PROMPTS, **kw):
    ids, mask = _encode(tokenizer, prompts)
    kw.setdefault("num_generations", 1)
    kw.setdefault("max_new_tokens", 6)
    return sample(model, ids, mask, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, **kw)


def _check_eos_layout(ro: Rollout, eos: int, pad: int, max_new: int):
    """completion_mask is 1 up to and including the first EOS, pad after it; no EOS = truncated."""
    for ids, m, trunc in zip(ro.completion_ids.tolist(), ro.completion_mask.tolist(), ro.truncated.tolist()):
        if eos in ids:
            e = ids.index(eos)
            assert m == [1] * (e + 1) + [0] * (len(ids) - e - 1)
            assert all(t == pad for t in ids[e + 1:])
            assert not trunc
        else:
            assert trunc and len(ids) == max_new and m == [1] * max_new


def test_positions_skip_left_padding():
    mask = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
    assert positions_from_mask(mask).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]


def test_shapes_and_group_contiguity(model, tokenizer):
    B, G, T = len(PROMPTS), 3, 5
    ids, mask = _encode(tokenizer)
    gen = torch.Generator().manual_seed(0)
    ro = sample(model, ids, mask, num_generations=G, max_new_tokens=T, eos_id=tokenizer.eos_token_id,
                pad_id=tokenizer.pad_token_id, temperature=1.5, generator=gen)
    N = B * G
    assert ro.prompt_ids.shape == (N, ids.size(1)) and ro.prompt_mask.shape == (N, ids.size(1))
    assert ro.completion_ids.shape == ro.completion_mask.shape and ro.completion_ids.size(0) == N
    assert 1 <= ro.completion_ids.size(1) <= T and ro.truncated.shape == (N,) and ro.truncated.dtype == torch.bool
    assert ro.old_logps is None
    for k in range(B):  # rows [kG, (k+1)G) are the G completions of prompt k
        for g in range(G):
            assert torch.equal(ro.prompt_ids[k * G + g], ids[k]) and torch.equal(ro.prompt_mask[k * G + g], mask[k])
    # width is the longest completion, not max_new_tokens, when every row ended early
    assert ro.completion_ids.size(1) == int(ro.completion_mask.sum(-1).max())


def test_mask_eos_pad_and_truncated_flags(model, tokenizer):
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    ro = _sample(model, tokenizer, num_generations=4, max_new_tokens=3, temperature=2.0,
                 generator=torch.Generator().manual_seed(1))
    _check_eos_layout(ro, eos, pad, 3)
    # greedy decoding needs L tokens up to its EOS: with L - 1 it is truncated, with L it is not
    free = _sample(model, tokenizer, ["12+7="], max_new_tokens=8, greedy=True)
    assert not free.truncated[0], "the demo model should end '12+7=' within 8 tokens"
    L = int(free.completion_mask.sum())
    assert L >= 2
    short = _sample(model, tokenizer, ["12+7="], max_new_tokens=L - 1, greedy=True)
    assert short.truncated.tolist() == [True] and short.completion_mask.tolist() == [[1] * (L - 1)]
    full = _sample(model, tokenizer, ["12+7="], max_new_tokens=L, greedy=True)
    assert full.truncated.tolist() == [False] and full.completion_ids[0, -1].item() == eos
    _check_eos_layout(full, eos, pad, L)


@pytest.mark.parametrize("module", ["own", "hf"])
def test_greedy_matches_hf_generate_per_prompt(model, hf_model, tokenizer, module):
    """Positions come from the mask, so a left-padded batch must decode like each prompt alone, on
    either module, as the Hugging Face module's `generate` does."""
    eos, T = tokenizer.eos_token_id, 6
    ro = _sample(model if module == "own" else hf_model, tokenizer, max_new_tokens=T, greedy=True)
    hf_model.eval()
    for i, p in enumerate(PROMPTS):
        ids = torch.tensor([tokenizer(p).input_ids])
        with torch.no_grad():
            ref = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=T,
                                 eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)[0, ids.size(1):].tolist()
        ref = ref[:ref.index(eos) + 1] if eos in ref else ref
        ours = ro.completion_ids[i][ro.completion_mask[i].bool()].tolist()
        assert ours == ref, p
    assert not ro.truncated.all()  # the comparison covered EOS handling too


def test_sampler_restores_train_mode(model, tokenizer):
    model.train()
    _sample(model, tokenizer, max_new_tokens=2, greedy=True)
    assert model.training


def test_fixed_generator_is_reproducible(model, tokenizer):
    kw = dict(num_generations=4, max_new_tokens=5, temperature=1.5)
    a = _sample(model, tokenizer, generator=torch.Generator().manual_seed(7), **kw)
    b = _sample(model, tokenizer, generator=torch.Generator().manual_seed(7), **kw)
    c = _sample(model, tokenizer, generator=torch.Generator().manual_seed(8), **kw)
    assert torch.equal(a.completion_ids, b.completion_ids) and torch.equal(a.completion_mask, b.completion_mask)
    assert not torch.equal(a.completion_ids, c.completion_ids)  # 20 rows of 5 tokens at T=1.5: differs
    # with G copies at high temperature the copies of one prompt are not all identical
    rows = a.completion_ids.view(len(PROMPTS), 4, -1)
    assert any(len({tuple(r.tolist()) for r in group}) > 1 for group in rows)


def test_top_k_1_equals_greedy(model, tokenizer):
    greedy = _sample(model, tokenizer, num_generations=2, greedy=True)
    topk = _sample(model, tokenizer, num_generations=2, top_k=1, temperature=3.0,
                   generator=torch.Generator().manual_seed(0))
    assert torch.equal(greedy.completion_ids, topk.completion_ids)
    assert torch.equal(greedy.completion_mask, topk.completion_mask)


# ---------------------------------------------------------------- filter_logits


def _nucleus_size(probs: list[float], top_p: float) -> int:
    """Smallest k whose top-k probability mass reaches top_p."""
    total = 0.0
    for k, p in enumerate(sorted(probs, reverse=True), 1):
        total += p
        if total >= top_p:
            return k
    return len(probs)


@pytest.mark.parametrize("top_p, kept", [(0.4, 1), (0.75, 2), (0.85, 3), (0.99, 4)])
def test_top_p_keeps_minimal_nucleus_hand(top_p, kept):
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    out = filter_logits(probs.log(), top_p=top_p)
    keep = torch.isfinite(out[0])
    order = [1, 3, 2, 0]  # by probability
    assert keep[order[:kept]].all() and not keep[order[kept:]].any()
    assert torch.equal(out[0][keep], probs.log()[0][keep])  # survivors unchanged


def test_top_p_matches_brute_force():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(32, 50, generator=g) * 2  # (B, V)
    for top_p in (0.1, 0.5, 0.9):
        out = filter_logits(logits, top_p=top_p)
        for row, filt in zip(logits, out):
            k = _nucleus_size(row.softmax(-1).tolist(), top_p)
            kept = torch.isfinite(filt)
            assert int(kept.sum()) == k
            assert kept[row.topk(k).indices].all()  # and they are the k most likely tokens


def test_top_k_and_off():
    logits = torch.tensor([[1.0, 4.0, 3.0, 2.0]])
    assert torch.isfinite(filter_logits(logits, top_k=2)).tolist() == [[False, True, True, False]]
    assert torch.equal(filter_logits(logits), logits)  # top_k=0, top_p=1: unchanged
    assert torch.equal(filter_logits(logits, top_k=10), logits)
    # top-k first, then top-p over the renormalised survivors: p = softmax([4, 3]) = [0.73, 0.27]
    both = filter_logits(logits, top_k=2, top_p=0.7)
    assert torch.isfinite(both).tolist() == [[False, True, False, False]]


# ---------------------------------------------------------------- select / concat


def _rollout(P, T, n, fill, with_old=False):
    pids = torch.full((n, P), fill)
    pmask = torch.ones(n, P, dtype=torch.long)
    cids = torch.full((n, T), fill + 100)
    cmask = torch.ones(n, T, dtype=torch.long)
    old = torch.full((n, T), -float(fill)) if with_old else None
    return Rollout(pids, pmask, cids, cmask, torch.tensor([fill % 2 == 0] * n), old)


def test_select_rows():
    ro = _rollout(2, 3, 4, 1, with_old=True)
    ro.completion_ids[:, 0] = torch.arange(4)
    out = select(ro, [3, 1])
    assert out.completion_ids[:, 0].tolist() == [3, 1]
    assert out.old_logps.shape == (2, 3) and out.prompt_ids.shape == (2, 2)
    assert select(_rollout(2, 3, 4, 1), torch.tensor([0])).old_logps is None


def test_concat_pads_prompts_left_completions_right():
    a, b = _rollout(2, 4, 2, 1, with_old=True), _rollout(3, 2, 1, 2, with_old=True)
    out = concat([a, b], pad_id=0)
    assert out.prompt_ids.shape == (3, 3) and out.completion_ids.shape == (3, 4)
    assert out.prompt_ids[0].tolist() == [0, 1, 1] and out.prompt_mask[0].tolist() == [0, 1, 1]  # left pad
    assert out.completion_ids[2].tolist() == [102, 102, 0, 0]  # right pad
    assert out.completion_mask[2].tolist() == [1, 1, 0, 0]
    assert out.old_logps[2].tolist() == [-2.0, -2.0, 0.0, 0.0]
    assert out.truncated.tolist() == [False, False, True]
    assert concat([a, _rollout(3, 2, 1, 2)], pad_id=0).old_logps is None  # only when every part has them


def test_gumbel_draw_follows_the_softmax():
    """draw() samples by Gumbel-max: frequencies match softmax(logits / T), and filters hold."""
    from preftune.rollout.sampler import draw

    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, -3.0]]).expand(40000, -1)
    g = torch.Generator().manual_seed(0)
    tok = draw(logits, 0.8, 0, 1.0, False, g)
    freq = torch.bincount(tok, minlength=5).float() / tok.numel()
    torch.testing.assert_close(freq, (logits[0] / 0.8).softmax(-1), rtol=0, atol=0.01)
    assert set(draw(logits, 0.8, 2, 1.0, False, g).tolist()) == {0, 1}  # top_k=2
    assert torch.equal(draw(logits, 0.8, 0, 1.0, True, g), torch.zeros(40000, dtype=torch.long))


@pytest.mark.parametrize("forward", ["own", "hf"])
def test_finished_rows_leave_the_batch(model, hf_model, tokenizer, monkeypatch, forward):
    """Rows that emitted EOS stop being run (compaction), and the result still matches per-prompt
    greedy decoding (the HF-generate parity test above covers the tokens themselves), with
    preftune's own module and with the HF module."""
    from preftune.model.llama import Llama

    sizes = []
    if forward == "hf":
        model = hf_model
        handle = model.register_forward_pre_hook(lambda m, a, kw: sizes.append(kw["input_ids"].size(0)),
                                                 with_kwargs=True)
    else:
        hidden, step = Llama.hidden, Llama.step  # prefill, decode steps
        monkeypatch.setattr(Llama, "hidden", lambda self, ids, *a, **k: sizes.append(ids.size(0))
                            or hidden(self, ids, *a, **k))
        monkeypatch.setattr(Llama, "step", lambda self, tok, *a, **k: sizes.append(tok.size(0))
                            or step(self, tok, *a, **k))
        handle = None
    try:
        ro = _sample(model, tokenizer, num_generations=2, max_new_tokens=8, greedy=True)
    finally:
        if handle is not None:
            handle.remove()
    lengths = ro.completion_mask.sum(1)
    early = (lengths < 8) & ~ro.truncated  # rows that finished before the last token
    assert early.any()
    assert sizes[0] == len(PROMPTS)  # prefill: each prompt once
    assert sizes[1] == 2 * len(PROMPTS) and min(sizes[1:]) < 2 * len(PROMPTS)
    # a decode step runs no more rows than were still sampling at that step
    for t, n in enumerate(sizes[1:], start=1):
        assert n >= int((lengths > t).sum())


@pytest.mark.parametrize("forward", ["own", "hf"])
def test_decoding_runs_in_inference_mode_and_hands_back_normal_tensors(model, hf_model, tokenizer, monkeypatch,
                                                                       forward):
    """The own module's steps run under inference mode (no autograd bookkeeping per op); the HF
    module's do not (its hooks may keep what they make), and neither runs with grad. Either way the
    rollout is made of normal tensors, which a training pass can save for its backward (an
    inference tensor would raise), and the tokens are those of a plain no-grad decode."""
    import preftune.rollout.sampler as sampler

    seen = []
    cls = sampler._HFDecoder if forward == "hf" else sampler._OwnDecoder
    model = hf_model if forward == "hf" else model
    step = cls.step
    monkeypatch.setattr(cls, "step", lambda self, *a: seen.append(
        (torch.is_inference_mode_enabled(), torch.is_grad_enabled())) or step(self, *a))
    ro = _sample(model, tokenizer, num_generations=2, max_new_tokens=6, generator=torch.Generator().manual_seed(3))
    assert seen and set(seen) == {(forward == "own", False)}  # never with grad
    for t in (ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, ro.truncated):
        assert not t.is_inference()
    init = cls.__init__
    monkeypatch.setattr(cls, "__init__", lambda self, *a: init(self, *a) or setattr(self, "inference", False))
    plain = _sample(model, tokenizer, num_generations=2, max_new_tokens=6, generator=torch.Generator().manual_seed(3))
    assert torch.equal(plain.completion_ids, ro.completion_ids)
    emb = model.get_input_embeddings() if forward == "hf" else model.model.embed_tokens
    (emb(torch.cat([ro.prompt_ids, ro.completion_ids], 1)).sum()).backward()  # the ids can be saved for backward
    assert emb.weight.grad is not None
    model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("kw", [
    dict(num_generations=3, max_new_tokens=8, temperature=1.3),
    dict(num_generations=2, max_new_tokens=7, temperature=1.0, top_k=5, top_p=0.9),
    dict(num_generations=1, max_new_tokens=6, greedy=True),
    dict(num_generations=2, max_new_tokens=1),
], ids=["sample", "top_k_top_p", "greedy", "one_token"])
def test_own_and_hf_modules_give_the_same_rollout(tokenizer, kw):
    """The same weights (float64) sample the same tokens through either decoder, rows leaving the
    batch as they finish."""
    from transformers import AutoModelForCausalLM

    from preftune.model.llama import Llama
    from tests.conftest import MODEL_DIR

    hf = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float64)
    own = Llama.of(hf)
    ids, mask = _encode(tokenizer, PROMPTS + ["7+8=", "1+1=", "13+2="])
    assert (mask == 0).any()
    got, want = (sample(m, ids, mask, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                        generator=torch.Generator().manual_seed(11), **kw) for m in (own, hf))
    for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(got, k), getattr(want, k)), k
    if kw["max_new_tokens"] > 1:
        lengths = got.completion_mask.sum(1)
        assert (~got.truncated).any() and lengths.min() < lengths.max()


# ---------------------------------------------------------------- behaviour log-probs


@pytest.mark.parametrize("forward", ["own", "hf"])
def test_behaviour_logps_are_the_trainers_log_probs_of_the_sampling_distribution(model, hf_model, tokenizer, forward):
    """Each drawn token's log-prob under the distribution that drew it (temperature, top-k, top-p
    renormalised) equals `completion_logps` with the same top_k/top_p on the same weights (float64),
    and differs from the full softmax's, which is what drifts when a trainer ignores the filter."""
    from preftune.model.logps import completion_logps

    m = (model if forward == "own" else hf_model).double()
    torch.manual_seed(0)
    with torch.no_grad():  # larger logits: top-k and top-p cut real mass
        for p in m.parameters():
            p.mul_(3.0)
    opts = dict(temperature=0.7, top_k=5, top_p=0.9)
    ro = _sample(m, tokenizer, num_generations=4, generator=torch.Generator().manual_seed(1), with_logps=True, **opts)
    assert ro.sampling_logps.shape == ro.completion_ids.shape
    mask = ro.completion_mask.bool()
    trainer, _ = completion_logps(m, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask, **opts)
    assert torch.allclose(trainer[mask], ro.sampling_logps[mask].double(), atol=1e-5)  # behaviour logps are float32
    assert (ro.sampling_logps[~mask] == 0).all()
    full, _ = completion_logps(m, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                               temperature=0.7)
    assert (trainer[mask] - full[mask]).min() >= -1e-12  # renormalising over fewer tokens only raises a log-prob
    assert (trainer[mask] - full[mask]).mean() > 1e-3


def test_greedy_behaviour_logps_are_zero(model, tokenizer):
    ro = _sample(model, tokenizer, greedy=True, with_logps=True)
    assert (ro.sampling_logps == 0).all()


def test_select_and_concat_keep_behaviour_logps(model, tokenizer):
    a = _sample(model, tokenizer, prompts=PROMPTS[:2], with_logps=True, generator=torch.Generator().manual_seed(0))
    b = _sample(model, tokenizer, prompts=PROMPTS[2:], with_logps=True, generator=torch.Generator().manual_seed(0))
    both = concat([a, b], tokenizer.pad_token_id)
    assert both.sampling_logps.shape == both.completion_ids.shape
    assert torch.equal(select(both, [0]).sampling_logps[:, :a.sampling_logps.size(1)], a.sampling_logps[:1])
