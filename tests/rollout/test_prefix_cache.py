"""The own sampler's caches across turns: a later turn prefills only its new tokens and samples what
a full prefill samples."""
from __future__ import annotations

import torch

from preftune.rollout.engine import SamplerEngine

PROMPTS = ["12+7=", "3+4=", "19+19=", "0+0=", "5+11="]


def _own64():
    from transformers import AutoModelForCausalLM

    from preftune.model.llama import Llama
    from tests.conftest import MODEL_DIR

    return Llama.of(AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float64))


def _turn(engine, model, tok, prompts, G, seed, max_new=6):
    return engine.generate(prompts, model=model, num_generations=G, max_new_tokens=max_new,
                           eos_id=tok.eos_token_id, pad_id=tok.pad_token_id, temperature=1.0,
                           generator=torch.Generator().manual_seed(seed))


def _rows(ro) -> list[list[int]]:
    """Each row's prompt + completion ids (unpadded)."""
    out = []
    for p, pm, c, cm in zip(ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask):
        out.append(p[pm.bool()].tolist() + c[cm.bool()].tolist())
    return out


def test_a_later_turn_prefills_only_its_new_tokens_and_samples_the_same(tokenizer):
    """Turn 2 extends every row of turn 1 by a tool turn's tokens (one prompt extends nothing):
    inside a conversation the prefill reads only the new tokens, the kept ones are counted, and the
    tokens and log-probs equal a fresh engine's full prefill (float64)."""
    model, tok = _own64(), tokenizer
    suffix = tok("\nT:ok\nA:", add_special_tokens=False).input_ids
    widths = []
    model.register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    engine = SamplerEngine(with_logps=True)
    with engine.conversation() as kept:
        first = _turn(engine, model, tok, [tok(p).input_ids for p in PROMPTS], G=2, seed=1)
        lengths = first.completion_mask.sum(1)
        assert (~first.truncated).any() and lengths.min() < lengths.max()  # rows leave the batch
        second = [r + suffix for r in _rows(first)] + [tok("7+8=").input_ids]
        widths.clear()
        got = _turn(engine, model, tok, second, G=1, seed=2)
        # each extending row reuses all it had but, at most, its stop token (never fed)
        assert kept.reused >= sum(len(r) for r in _rows(first)) - len(_rows(first))
        assert widths == [max(len(suffix) + 1, len(tok("7+8=").input_ids))]
    assert engine.prefixes is None
    want = _turn(SamplerEngine(with_logps=True), model, tok, second, G=1, seed=2)
    assert torch.equal(got.completion_ids, want.completion_ids)
    assert torch.equal(got.completion_mask, want.completion_mask)
    assert torch.allclose(got.sampling_logps, want.sampling_logps, atol=1e-6)


def test_outside_a_conversation_nothing_is_kept(tokenizer):
    model, tok = _own64(), tokenizer
    engine = SamplerEngine()
    first = _turn(engine, model, tok, [tok(p).input_ids for p in PROMPTS], G=1, seed=1)
    widths = []
    model.register_forward_pre_hook(lambda m, args: widths.append(args[0].shape[1]))
    second = [r + [tok.eos_token_id] for r in _rows(first)]
    _turn(engine, model, tok, second, G=1, seed=2)
    assert widths == [max(len(r) for r in second)]


def test_memory_the_sampler_did_not_write_is_never_read(tokenizer, nan_memory):
    """With unfilled allocations NaN (`nan_memory`), a conversation's two turns sample the same
    tokens and log-probs as with clean memory. (A later turn's shorter kept prefixes leave cache
    columns unwritten: masked, they still add 0 x their value.)"""
    model, tok = _own64(), tokenizer

    def two_turns():
        engine = SamplerEngine(with_logps=True)
        with engine.conversation():
            first = _turn(engine, model, tok, [tok(p).input_ids for p in PROMPTS], G=2, seed=1)
            second = [r + tok("\nT:ok\nA:", add_special_tokens=False).input_ids
                      for r in _rows(first)] + [tok("7+8=").input_ids]
            return first, _turn(engine, model, tok, second, G=1, seed=2)

    want = two_turns()
    nan_memory()
    got = two_turns()
    for a, b in zip(want, got):
        assert torch.equal(a.completion_ids, b.completion_ids)
        assert torch.equal(a.sampling_logps, b.sampling_logps)
