"""The lean decoder (`preftune/decoder.py`) against the Hugging Face modules it replays (float64):
logits and gradients per architecture, left padding, KV decoding, the tree mask, the cases it must
refuse, the `model.lean_forward` switch, and the sampler giving the same rollouts on either path."""
from __future__ import annotations

import pytest
import torch

from preftune.data.tensors import left_pad, positions_from_mask
from preftune.model import llama as D
from preftune.rollout import sampler as S
from tests.conftest import MODEL_DIR

VOCAB = 259


def tiny(model_type: str, dtype=torch.float64, seed: int = 0, **overrides):
    """A 2-layer random model of `model_type` whose every parameter (biases and norm weights too,
    which HF initialises to 0 and 1) is random, so each term of the forward pass matters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=None, eos_token_id=1)
    cfg = AutoConfig.for_model(model_type, **(kw | overrides))
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float64).to(p.dtype)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.2 * noise)
    return model.eval()


ARCHS = {
    "qwen2": ("qwen2", {}),  # q/k/v biases
    "qwen2-tied": ("qwen2", {"tie_word_embeddings": True}),
    "llama": ("llama", {}),
    "llama-bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    "llama-mha": ("llama", {"num_key_value_heads": 4}),
    "llama-yarn": ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0,
                                                  "original_max_position_embeddings": 64}}),
    "qwen3": ("qwen3", {"head_dim": 16}),  # q_norm/k_norm, head_dim != hidden / heads
    "qwen3-mqa": ("qwen3", {"head_dim": 8, "num_key_value_heads": 1}),
    "mistral": ("mistral", {"sliding_window": None}),
}


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_lean_forward_and_gradients_equal_hf(arch):
    model_type, kw = ARCHS[arch]
    model = tiny(model_type, **kw)
    assert D.supported(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 11), generator=g)
    pos = torch.arange(11)[None] + torch.tensor([[0], [5]])  # the second row starts at position 5
    w = torch.randn(2, 11, VOCAB, generator=g, dtype=torch.float64)

    want = model(input_ids=ids, position_ids=pos).logits  # (2, 11, V)
    (want * w).sum().backward()
    want_grads = grads(model)
    lean = D.Lean.of(model)
    got = lean.logits(lean.forward(ids, lean.rope(pos), None))
    (got * w).sum().backward()
    got_grads = grads(model)

    assert got.dtype == torch.float64 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert got_grads.keys() == want_grads.keys() == {n for n, _ in model.named_parameters()}
    for name, gw in want_grads.items():
        assert gw.abs().max() > 0, name  # every parameter is on the path
        torch.testing.assert_close(got_grads[name], gw, rtol=0, atol=1e-10 * gw.abs().max().item(), msg=name)


def padded_mask(attn: torch.Tensor) -> torch.Tensor:
    """(B, L) 0/1 -> (B, 1, L, L): causal over real tokens; a padding query sees only itself."""
    L = attn.size(1)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    return (causal & attn.bool()[:, None, None, :]) | torch.eye(L, dtype=torch.bool)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama-bias"])
def test_left_padded_prompts_with_mask_equal_hf(arch):
    model_type, kw = ARCHS[arch]
    model = tiny(model_type, **kw)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 5, 1)]
    ids, attn = left_pad(seqs, pad_id=0)  # (4, 7)
    pos = positions_from_mask(attn)
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        lean = D.Lean.of(model)
        got = lean.logits(lean.forward(ids, lean.rope(pos), padded_mask(attn)))
    real = attn.bool()
    assert (~real).any()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-10)
    # and each row equals the unpadded sequence alone
    for i, s in enumerate(seqs):
        with torch.no_grad():
            alone = model(input_ids=torch.tensor([s])).logits[0]
        torch.testing.assert_close(got[i, -len(s):], alone, rtol=0, atol=1e-10)


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3-mqa"])
def test_kv_decode_equals_full_forward(arch, grad):
    """Prefill left-padded prompts, decode token by token into preallocated buffers (rows leaving the
    batch half-way, one row's later tokens unattended as after its EOS): each step's logits equal
    those of one forward over the whole sequence."""
    model_type, kw = ARCHS[arch]
    model = tiny(model_type, **kw)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 2, 6)]
    p_ids, p_mask = left_pad(prompts, pad_id=0)  # (3, 6)
    B, P, T = 3, p_ids.size(1), 6
    comp = torch.randint(3, VOCAB, (B, T), generator=g)
    attn = torch.cat([p_mask, torch.ones(B, T, dtype=torch.long)], 1)  # (B, P+T)
    attn[1, P + 3:] = 0  # row 1 "finished" at its third token: later tokens are not attended to
    ids = torch.cat([p_ids, comp], 1)
    pos_full = positions_from_mask(attn)
    # positions of a finished row keep counting, as in the sampler (next_pos + 1 per step)
    pos_full[:, P:] = p_mask.sum(1, keepdim=True) + torch.arange(T)
    mask_full = (torch.ones(P + T, P + T, dtype=torch.bool).tril() & attn.bool()[:, None, None, :]) \
        | torch.eye(P + T, dtype=torch.bool)
    with torch.set_grad_enabled(grad):
        lean = D.Lean.of(model)
        full = lean.logits(lean.forward(ids, lean.rope(pos_full), mask_full))  # (B, P+T, V)
        kv = lean.new_kv(B, P + T)
        assert kv.keys.shape == (2, B, lean.kv_heads, P + T, lean.head_dim)
        h = lean.forward(p_ids, lean.rope(pos_full[:, :P]), padded_mask(p_mask), kv=kv)
        steps = {P - 1: lean.logits(h[:, -1])}
        rows = torch.arange(B)
        for t in range(T):
            col = P + t
            if t == 5:  # row 1 leaves the batch (and the cache)
                keep = torch.tensor([0, 2])
                kv.select(keep, filled=col)
                rows = rows[keep]
                assert kv.keys.shape[1] == 2
            m = attn[rows, :col + 1].bool()[:, None, None, :]
            h = lean.forward(ids[rows, col:col + 1], lean.rope(pos_full[rows, col:col + 1]), m, kv=kv, start=col)
            steps[col] = (rows, lean.logits(h[:, -1]))
    torch.testing.assert_close(steps[P - 1].detach(), full[:, P - 1].detach(), rtol=0, atol=1e-10)
    compared = 0
    for col, (rows, logits) in ((c, v) for c, v in steps.items() if c >= P):
        live = attn[rows, col].bool()  # an unattended (finished) token's own logits are never used
        compared += int(live.sum())
        torch.testing.assert_close(logits.detach()[live], full.detach()[rows[live], col], rtol=0, atol=1e-10,
                                   msg=f"column {col}")
    assert compared == int(attn[:, P:].sum())
    # and the full forward itself is HF's, on the attended tokens
    with torch.no_grad():
        want = model(input_ids=ids, attention_mask=attn, position_ids=pos_full).logits
    torch.testing.assert_close(full.detach()[attn.bool()], want[attn.bool()], rtol=0, atol=1e-10)


@pytest.mark.parametrize("case", ["chunked_prefill", "decode_with_grad"])
def test_kv_without_mask_is_causal_over_the_cache(case):
    """mask=None with `kv`: "plain causal attention", attention over columns 0..start+L-1. A query at
    column start+i must see keys 0..start+i, as the no-grad one-token decode step does.

    Fails on 5088763: `_attend` passes `is_causal=True` to SDPA, whose causal mask is top-left
    aligned when L != S, so with start > 0 query i sees keys 0..i only (chunked prefill; a one-token
    step with grad enabled sees key 0 only), while the same one-token step under no_grad (the
    matmul branch) sees every column: the result depends on the grad mode."""
    model = tiny("qwen2")
    ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    pos = torch.arange(10).expand(2, 10)
    lean = D.Lean.of(model)
    with torch.no_grad():
        full = lean.logits(lean.forward(ids, lean.rope(pos), None))  # (2, 10, V)
    kv = lean.new_kv(2, 10)
    with torch.no_grad():
        lean.forward(ids[:, :6], lean.rope(pos[:, :6]), None, kv=kv)
    if case == "chunked_prefill":
        with torch.no_grad():
            got = lean.logits(lean.forward(ids[:, 6:], lean.rope(pos[:, 6:]), None, kv=kv, start=6))
    else:
        out = []
        for t in range(6, 10):  # grad enabled: the SDPA branch of `_attend`
            out.append(lean.logits(lean.forward(ids[:, t:t + 1], lean.rope(pos[:, t:t + 1]), None, kv=kv, start=t)))
        got = torch.cat(out, 1).detach()
    err = (got - full[:, 6:]).abs().max().item()
    assert err < 1e-10, f"{case}: mask=None with kv/start differs from the full causal forward by {err:.3g}"


def test_kv_buffers_select_copies_filled_columns_of_kept_rows():
    keys = torch.arange(2 * 4 * 1 * 5 * 3, dtype=torch.float64).view(2, 4, 1, 5, 3)  # (layers, N, h, cap, d)
    kv = D.KVBuffers(keys.clone(), -keys.clone())
    kv.select(torch.tensor([3, 1]), filled=2)
    assert kv.keys.shape == kv.values.shape == (2, 2, 1, 5, 3)
    assert torch.equal(kv.keys[:, :, :, :2], keys[:, [3, 1], :, :2])
    assert torch.equal(kv.values[:, :, :, :2], -keys[:, [3, 1], :, :2])


def test_tree_mask_by_hand():
    """Rule: a query attends an earlier-or-same key of its own segment that is on the trunk (branch 0)
    or on the query's own branch; padding (segment -1) attends only itself, and nothing attends it."""
    # row 0: one sequence, trunk 0-1, branch 1 at 2-3, branch 2 at 4, then two padding tokens
    # row 1: sequence 0 (trunk 0, branches 1 and 2 of one token), then sequence 1 (trunk 3-4, branches 5, 6)
    segment = torch.tensor([[0, 0, 0, 0, 0, -1, -1], [0, 0, 0, 1, 1, 1, 1]])
    branch = torch.tensor([[0, 0, 1, 1, 2, 0, 0], [0, 1, 2, 0, 0, 1, 2]])
    want0 = [[1, 0, 0, 0, 0, 0, 0],
             [1, 1, 0, 0, 0, 0, 0],
             [1, 1, 1, 0, 0, 0, 0],
             [1, 1, 1, 1, 0, 0, 0],
             [1, 1, 0, 0, 1, 0, 0],  # branch 2 sees the trunk and itself, not branch 1
             [0, 0, 0, 0, 0, 1, 0],  # padding: itself only
             [0, 0, 0, 0, 0, 0, 1]]
    want1 = [[1, 0, 0, 0, 0, 0, 0],
             [1, 1, 0, 0, 0, 0, 0],
             [1, 0, 1, 0, 0, 0, 0],
             [0, 0, 0, 1, 0, 0, 0],  # a new sequence: nothing of sequence 0
             [0, 0, 0, 1, 1, 0, 0],
             [0, 0, 0, 1, 1, 1, 0],
             [0, 0, 0, 1, 1, 0, 1]]
    mask = D.tree_mask(segment, branch)
    assert mask.shape == (2, 1, 7, 7) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == want0
    assert mask[1, 0].int().tolist() == want1


def test_tree_mask_single_row_example():
    mask = D.tree_mask(torch.tensor([[0, 0, 0, 0, 0, -1]]), torch.tensor([[0, 0, 1, 1, 2, 0]]))
    assert mask[0, 0].int().tolist() == [[1, 0, 0, 0, 0, 0],
                                         [1, 1, 0, 0, 0, 0],
                                         [1, 1, 1, 0, 0, 0],
                                         [1, 1, 1, 1, 0, 0],
                                         [1, 1, 0, 0, 1, 0],
                                         [0, 0, 0, 0, 0, 1]]


# ---------------------------------------------------------------- what it refuses


def _lora(model):
    from peft import LoraConfig, get_peft_model

    return get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))


def _refusals():
    def peft_model(m):
        pytest.importorskip("peft")
        return _lora(m)

    def peft_base(m):  # the HF module under the adapters: its q/v projections are LoRA layers now
        pytest.importorskip("peft")
        return _lora(m).get_base_model()

    def peft_config_attr(m):
        m.peft_config = {"default": object()}
        return m

    def checkpointing(m):
        if hasattr(m, "activation_checkpointing_enable"):  # transformers >= 5.24
            m.activation_checkpointing_enable()
        else:
            m.gradient_checkpointing_enable()
        return m

    def lean_off(m):
        m.preftune_lean = False
        return m

    def fsdp_flag(m):
        m.preftune_one_forward = True
        return m

    return {"peft_model": peft_model, "peft_base": peft_base, "peft_config_attr": peft_config_attr,
            "gradient_checkpointing": checkpointing, "lean_forward_false": lean_off, "fsdp2": fsdp_flag}


REFUSALS = _refusals()


@pytest.mark.parametrize("case", list(REFUSALS))
def test_supported_refuses_wrapped_models(case):
    model = tiny("qwen2", dtype=torch.float32)
    assert D.supported(model) and D.Lean.of(model) is not None  # the same model, untouched, is replayed
    model = REFUSALS[case](model)
    assert not D.supported(model) and D.Lean.of(model) is None


@pytest.mark.parametrize("model_type,kw", [
    ("gpt2", {}),
    ("mistral", {}),  # MistralConfig's default sliding_window (4096)
    ("mistral", {"sliding_window": 8}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8}),
    ("llama", {"hidden_act": "gelu"}),
    ("llama", {"attention_dropout": 0.1}),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
], ids=["gpt2", "mistral-default-window", "mistral-window", "qwen2-window", "gelu", "attention-dropout",
        "dynamic-rope"])
def test_supported_refuses_other_architectures(model_type, kw):
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type == "gpt2":
        cfg = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, bos_token_id=1,
                                   eos_token_id=1)
    else:
        cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **kw)
    model = AutoModelForCausalLM.from_config(cfg)
    assert not D.supported(model) and D.Lean.of(model) is None


def test_load_model_flags(make_config):
    """`model.lean_forward` reaches the model; bf16 mixed precision is replayed, checkpointing refused."""
    from preftune.config import ModelConfig
    from preftune.model.load import load_model

    cfg = make_config("model.lean_forward=false")
    assert cfg.model.lean_forward is False
    off = load_model(cfg.model, cfg.model.name_or_path)
    assert off.preftune_lean is False and not D.supported(off)
    ref = load_model(cfg.model, cfg.model.name_or_path, trainable=False)
    assert ref.preftune_lean is False and not D.supported(ref)
    on = load_model(make_config().model, str(MODEL_DIR))
    assert on.preftune_lean is True and D.supported(on)
    mixed = load_model(ModelConfig(dtype="bfloat16"), str(MODEL_DIR))
    assert next(mixed.parameters()).dtype == torch.float32 and D.supported(mixed)  # float32 masters, bf16 autocast
    frozen = load_model(ModelConfig(dtype="bfloat16"), str(MODEL_DIR), trainable=False)
    assert next(frozen.parameters()).dtype == torch.bfloat16 and D.supported(frozen)
    assert not D.supported(load_model(ModelConfig(gradient_checkpointing=True), str(MODEL_DIR)))


# ---------------------------------------------------------------- the sampler on either path


PROMPTS = ["12+7=", "3+4=", "19+19=", "0+0=", "5+11=", "7+8=", "1+1=", "13+2="]


@pytest.fixture(scope="module")
def model64():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float64)


class _Count:
    """Counts prefill/select calls of a decoder class (wrapping it)."""

    def __init__(self, monkeypatch, name):
        self.prefills = self.selects = 0
        cls = getattr(S, name)
        count = self

        class Counted(cls):
            def prefill(self, *a):
                count.prefills += 1
                return super().prefill(*a)

            def select(self, keep):
                count.selects += 1
                return super().select(keep)

        monkeypatch.setattr(S, name, Counted)


@pytest.mark.parametrize("kw", [
    dict(num_generations=3, max_new_tokens=8, temperature=1.3),
    dict(num_generations=2, max_new_tokens=7, temperature=1.0, top_k=5, top_p=0.9),
    dict(num_generations=1, max_new_tokens=6, greedy=True),
    dict(num_generations=2, max_new_tokens=1),
], ids=["sample", "top_k_top_p", "greedy", "one_token"])
def test_sampler_lean_and_hf_paths_give_the_same_rollout(model64, tokenizer, monkeypatch, kw):
    ids, mask = left_pad([tokenizer(p).input_ids for p in PROMPTS], tokenizer.pad_token_id)
    assert (mask == 0).any()  # left padding present
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def run():
        gen = torch.Generator().manual_seed(11)
        return S.sample(model64, ids, mask, eos_id=eos, pad_id=pad, generator=gen, **kw)

    lean, hf = _Count(monkeypatch, "_LeanDecoder"), _Count(monkeypatch, "_HFDecoder")
    got = run()
    assert lean.prefills == 1 and hf.prefills == 0  # the default took the lean decoder
    with monkeypatch.context() as mp:
        mp.setattr(D, "supported", lambda model: False)
        want = run()
    assert hf.prefills == 1 and lean.prefills == 1
    for k in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(got, k), getattr(want, k)), k
    if kw["max_new_tokens"] > 1:
        # EOS ended some rows early and not all at once, so finished rows left the batch (compaction)
        lengths = got.completion_mask.sum(1)
        assert (~got.truncated).any() and lengths.min() < lengths.max()
        assert lean.selects == hf.selects >= 1


@pytest.mark.parametrize("kw", [
    dict(num_generations=3, max_new_tokens=8, temperature=1.3),
    dict(num_generations=1, max_new_tokens=6, greedy=True),
    dict(num_generations=2, max_new_tokens=1),
], ids=["sample", "greedy", "one_token"])
def test_fixed_shape_decoding_gives_the_same_rollout(model64, tokenizer, monkeypatch, kw):
    """The fixed-shape step (what `model.cuda_graphs` replays on a GPU) runs every row over the whole
    buffer width and gives the lean decoder's rollout, finished rows and all. Compaction is off for
    the reference: with it, later draws take noise for fewer rows, a different (equally valid) stream."""
    ids, mask = left_pad([tokenizer(p).input_ids for p in PROMPTS], tokenizer.pad_token_id)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    def run():
        return S.sample(model64, ids, mask, eos_id=eos, pad_id=pad, generator=torch.Generator().manual_seed(11), **kw)

    with monkeypatch.context() as mp:
        mp.setattr(S._LeanDecoder, "compacts", False)
        want = run()
    rows = []
    forward, step = D.Lean.forward, D.Lean.step
    monkeypatch.setattr(D.Lean, "forward", lambda self, x, *a, **k: rows.append(x.shape) or forward(self, x, *a, **k))
    monkeypatch.setattr(D.Lean, "step", lambda self, x, *a, **k: rows.append((*x.shape, 1)) or step(self, x, *a, **k))
    monkeypatch.setattr(S, "_decoder", lambda model, cap: S._StaticDecoder(D.Lean(model, decoding=True), cap))
    got = run()
    for k in ("completion_ids", "completion_mask", "truncated"):
        assert torch.equal(getattr(got, k), getattr(want, k)), k
    n = len(PROMPTS) * kw["num_generations"]
    assert len(rows) > 1 or kw["max_new_tokens"] == 1  # the prefill, then steps until every row is done
    assert all(shape == (n, 1) for shape in rows[1:])  # every step: all rows, one token
    if kw["max_new_tokens"] > 1:
        lengths = got.completion_mask.sum(1)
        assert lengths.min() < lengths.max()  # some rows finished early, and kept decoding masked


def test_fixed_shape_step_writes_one_column_and_masks_the_rest():
    """With `start` a tensor the step writes keys/values at that column only and attends only where
    the mask says: the logits equal the growing-cache step's, whatever the unused columns hold."""
    model = tiny("qwen2")
    lean = D.Lean(model)
    ids = torch.randint(2, VOCAB, (2, 6), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(6).expand(2, 6)
    with torch.no_grad():
        grow = lean.new_kv(2, 8)
        lean.forward(ids[:, :5], lean.rope(pos[:, :5]), None, kv=grow)
        want = lean.forward(ids[:, 5:], lean.rope(pos[:, 5:]), None, kv=grow, start=5)  # (2, 1, H)
        fixed = lean.new_kv(2, 8)
        fixed.keys.fill_(1e4), fixed.values.fill_(-1e4)  # finite junk in the columns never written
        fixed.keys[:, :, :, :5], fixed.values[:, :, :, :5] = grow.keys[:, :, :, :5], grow.values[:, :, :, :5]
        mask = torch.zeros(2, 1, 1, 8, dtype=torch.bool)
        mask[..., :6] = True
        got = lean.forward(ids[:, 5:], lean.rope(pos[:, 5:]), mask, kv=fixed, start=torch.tensor([5]))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    assert torch.equal(fixed.keys[:, :, :, 5], grow.keys[:, :, :, 5])
    assert (fixed.keys[:, :, :, 6:] == 1e4).all() and (fixed.values[:, :, :, 6:] == -1e4).all()


def test_cuda_graphs_flag_reaches_the_model_and_stays_off_on_cpu(make_config, tokenizer):
    """`model.cuda_graphs` picks the graphed decoder only for a model on a GPU; on CPU it decodes as before."""
    from preftune.model.load import load_model

    cfg = make_config("model.cuda_graphs=true")
    model = load_model(cfg.model, cfg.model.name_or_path)
    assert model.preftune_cuda_graphs is True
    assert load_model(make_config().model, str(MODEL_DIR)).preftune_cuda_graphs is False
    assert type(S._decoder(model, 8)) is S._LeanDecoder


# ---------------------------------------------------------------- bf16: autocast over float32 masters, bf16 weights


@pytest.mark.parametrize("precision", ["autocast", "bf16_weights"])
def test_bf16_forward_and_decode_equal_the_module(precision):
    """Under bf16 autocast (float32 masters, as `model.dtype: bfloat16` trains) and with bf16 weights
    (frozen models), the lean forward gives the module's logits and the sampler the module's tokens."""
    from preftune.model.load import autocast
    from preftune.rollout import sampler

    model = tiny("qwen2", dtype=torch.float32)
    if precision == "autocast":
        model.preftune_autocast = torch.bfloat16
    else:
        model = model.to(torch.bfloat16)
    assert D.supported(model)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(2, VOCAB, (3, 12), generator=g)
    pos = torch.arange(12).expand(3, 12)
    with torch.no_grad(), autocast(model):
        want = model(input_ids=ids, position_ids=pos).logits
        lean = D.Lean(model)
        got = lean.logits(lean.forward(ids, lean.rope(pos), None))
        assert lean.new_kv(1, 4).keys.dtype == torch.bfloat16  # keys/values kept as computed
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=2e-2)
    prompt_ids, prompt_mask = ids[:, :5], torch.ones(3, 5, dtype=torch.long)
    prompt_mask[0, :2] = 0

    def run():
        return sampler.sample(model, prompt_ids, prompt_mask, num_generations=2, max_new_tokens=6, eos_id=VOCAB + 1,
                              pad_id=0, generator=torch.Generator().manual_seed(1))

    lean_ro = run()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(D, "supported", lambda model: False)
        hf_ro = run()
    assert torch.equal(lean_ro.completion_ids, hf_ro.completion_ids)
    with pytest.MonkeyPatch.context() as m:  # the fixed-shape step (what CUDA graphs replay), bf16 keys/values
        m.setattr(sampler, "_decoder", lambda model, cap: sampler._StaticDecoder(D.Lean(model, decoding=True), cap))
        static_ro = run()
    assert torch.equal(static_ro.completion_ids, lean_ro.completion_ids)


def test_remote_code_and_longrope_take_the_module_forward():
    """A class from outside transformers that reuses a model_type may change its forward (remote
    code); long-rope frequencies depend on each call's longest position. Both run the module."""
    from transformers import Qwen2ForCausalLM

    class RemoteQwen2(Qwen2ForCausalLM):  # defined here, as trust_remote_code would load it
        pass

    model = tiny("qwen2", dtype=torch.float32)
    assert D.supported(model) and D.stack_and_head(model) is not None
    remote = RemoteQwen2(model.config)
    assert not D.supported(remote) and D.stack_and_head(remote) is None
    model.model.rotary_emb.rope_type = "longrope"
    assert not D.supported(model)


def test_decoding_under_autocast_casts_the_fused_weights_once():
    """Decoding fuses q/k/v and gate/up and casts them to bf16 once per rollout; every other pass,
    with or without grad (a reference pass), reads the parameters themselves: no copy of the
    weights, nor of their gradients."""
    model = tiny("qwen2", dtype=torch.float32)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    same = lambda got, params: tuple(map(id, got)) == tuple(map(id, params))  # noqa: E731
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with torch.no_grad():
            lean = D.Lean(model, decoding=True)
            reference = D.Lean(model)
        assert lean.layers[0]["qkv"].dtype == lean.layers[0]["down"].dtype == lean.head.dtype == torch.bfloat16
        trained = D.Lean(model)
        for other in (reference, trained):
            assert same(other.layers[0]["qkv"], (attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight))
            assert same(other.layers[0]["qkv_bias"], (attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias))
            assert same(other.layers[0]["gate_up"], (mlp.gate_proj.weight, mlp.up_proj.weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_passes_with_and_without_grad_compute_the_same_bits(dtype):
    """The reference pass (no grad) runs the same arithmetic as the training forward (`_RMSNorm`,
    `_Rope`): while the policy still equals the reference, their log-probs agree to the bit, so
    the KL term's log-ratio is exactly 0 rather than rounding noise."""
    from preftune.model.logps import completion_logps

    model = tiny("qwen2", dtype=dtype)
    g = torch.Generator().manual_seed(5)
    p_ids, c_ids = torch.randint(3, VOCAB, (4, 7), generator=g), torch.randint(3, VOCAB, (4, 9), generator=g)
    masks = torch.ones(4, 7, dtype=torch.long), torch.ones(4, 9, dtype=torch.long)
    with torch.no_grad():
        ref, _ = completion_logps(model, p_ids, masks[0], c_ids, masks[1])
    policy, _ = completion_logps(model, p_ids, masks[0], c_ids, masks[1])
    assert policy.requires_grad and torch.equal(policy.detach(), ref)
