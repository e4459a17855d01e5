"""preftune's own Llama-family module against the Hugging Face modules (float64): logits and
gradients per architecture, left padding, the KV cache and the decode step, the tree mask, what it
leaves to the Hugging Face module, loading and saving Hugging Face folders, and LoRA."""
from __future__ import annotations

import pytest
import torch

from preftune.data.tensors import left_pad, positions_from_mask
from preftune.model import llama as D, ops
from preftune.model.families import own_class, unsupported
from preftune.model.llama import Llama
from tests.conftest import MODEL_DIR

VOCAB = 259


def tiny(model_type: str, dtype=torch.float64, seed: int = 0, **overrides):
    """A 2-layer random Hugging Face model of `model_type` whose every parameter (biases and norm
    weights too, which HF initialises to 0 and 1) is random, so each term of the forward matters."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128, tie_word_embeddings=False, pad_token_id=0,
              bos_token_id=None, eos_token_id=1)
    if model_type.endswith("_moe"):  # a loop over experts: transformers' grouped matmul takes no float64
        kw["experts_implementation"] = "eager"
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
    # GLM-4: post-norms, interleaved RoPE on half of each head, fused gate_up_proj, q/k/v biases
    "glm4": ("glm4", {"head_dim": 8}),
    "glm4-wide-rope": ("glm4", {"head_dim": 16, "partial_rotary_factor": 0.75, "attention_bias": False}),
    "glm4-tied-mqa": ("glm4", {"head_dim": 8, "num_key_value_heads": 1, "tie_word_embeddings": True}),
    # Qwen3-MoE: 4 experts, top 2; layer 1 dense (mlp_only_layers), or every other layer sparse
    "qwen3-moe": ("qwen3_moe", {"head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
                                "norm_topk_prob": True, "mlp_only_layers": [1]}),
    "qwen3-moe-sparse-step": ("qwen3_moe", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                            "moe_intermediate_size": 16, "decoder_sparse_step": 2}),
}


def pair(arch: str, dtype=torch.float64):
    """(the Hugging Face module, preftune's module of its family with the same weights)."""
    model_type, kw = ARCHS[arch]
    hf = tiny(model_type, dtype=dtype, **kw)
    return hf, own_class(hf.config).of(hf)


def grads(model) -> dict[str, torch.Tensor]:
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("arch", list(ARCHS))
def test_forward_and_gradients_equal_hf(arch):
    hf, own = pair(arch)
    assert unsupported(hf.config) is None and set(own.state_dict()) == set(hf.state_dict())
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (2, 11), generator=g)
    pos = torch.arange(11)[None] + torch.tensor([[0], [5]])  # the second row starts at position 5
    w = torch.randn(2, 11, VOCAB, generator=g, dtype=torch.float64)
    want = hf(input_ids=ids, position_ids=pos).logits  # (2, 11, V)
    (want * w).sum().backward()
    want_grads = grads(hf)
    got = own.logits(own.hidden(ids, pos))
    (got * w).sum().backward()
    got_grads = grads(own)
    assert got.dtype == torch.float64
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert got_grads.keys() == want_grads.keys()
    for name, gw in want_grads.items():
        assert gw.abs().max() > 0, name  # every parameter is on the path
        torch.testing.assert_close(got_grads[name], gw, rtol=0, atol=1e-10 * gw.abs().max().item(), msg=name)


def padded_mask(attn: torch.Tensor) -> torch.Tensor:
    """(B, L) 0/1 -> (B, 1, L, L): causal over real tokens; a padding query sees only itself."""
    L = attn.size(1)
    return (torch.ones(L, L, dtype=torch.bool).tril() & attn.bool()[:, None, None, :]) | torch.eye(L, dtype=torch.bool)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "llama-bias", "glm4", "qwen3-moe"])
def test_left_padded_prompts_with_mask_equal_hf(arch):
    hf, own = pair(arch)
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (7, 3, 5, 1)]
    ids, attn = left_pad(seqs, pad_id=0)  # (4, 7)
    pos = positions_from_mask(attn)
    with torch.no_grad():
        want = hf(input_ids=ids, attention_mask=attn, position_ids=pos).logits
        got = own.logits(own.hidden(ids, pos, padded_mask(attn)))
    real = attn.bool()
    assert (~real).any()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-10)


@pytest.mark.parametrize("arch", ["qwen2", "qwen2-tied", "llama-bias", "llama-mha", "llama-yarn", "mistral",
                                  "qwen3-mqa", "glm4", "glm4-wide-rope", "glm4-tied-mqa", "qwen3-moe",
                                  "qwen3-moe-sparse-step"])
def test_prefill_then_step_equals_the_full_forward(arch):
    """Prefill left-padded prompts into the cache, then decode token by token with `step` (fused
    weights, rows leaving the batch half-way, one row's later tokens unattended as after its EOS):
    each step's logits equal one forward over the whole sequence."""
    hf, own = pair(arch)
    g = torch.Generator().manual_seed(3)
    p_ids, p_mask = left_pad([torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 2, 6)], pad_id=0)
    B, P, T = 3, p_ids.size(1), 6
    comp = torch.randint(3, VOCAB, (B, T), generator=g)
    attn = torch.cat([p_mask, torch.ones(B, T, dtype=torch.long)], 1)  # (B, P+T)
    attn[1, P + 3:] = 0  # row 1 "finished" at its third token
    ids, pos = torch.cat([p_ids, comp], 1), positions_from_mask(attn)
    pos[:, P:] = p_mask.sum(1, keepdim=True) + torch.arange(T)  # a finished row's positions keep counting
    with torch.no_grad():
        full = own.logits(own.hidden(ids, pos, padded_mask(attn)))  # (B, P+T, V)
        kv = own.new_kv(B, P + T, torch.float64)
        steps = {P - 1: (torch.arange(B), own.logits(own.hidden(p_ids, pos[:, :P], padded_mask(p_mask), kv=kv)[:, -1]))}
        cos, sin = own.rope(torch.arange(P + T)[None])
        cos, sin, weights, rows = cos[0, :, 0], sin[0, :, 0], own.decoding(torch.float64), torch.arange(B)
        for t in range(T):
            col = P + t
            if t == 5:  # row 1 leaves the batch (and the cache)
                kv.select(torch.tensor([0, 2]), filled=col)
                rows = rows[[0, 2]]
            at = pos[rows, col]
            steps[col] = (rows, own.step(ids[rows, col], cos[at], sin[at], attn[rows, :col + 1].bool(), kv, col, weights))
        want = hf(input_ids=ids, attention_mask=attn, position_ids=pos).logits
    torch.testing.assert_close(full[attn.bool()], want[attn.bool()], rtol=0, atol=1e-10)
    compared = 0
    for col, (rows, logits) in steps.items():
        live = attn[rows, max(col, P - 1)].bool()
        compared += int(live.sum())
        torch.testing.assert_close(logits[live], full[rows[live], col], rtol=0, atol=1e-10, msg=f"column {col}")
    assert compared == int(attn[:, P - 1:].sum())


def test_kv_buffers_select_copies_filled_columns_of_kept_rows():
    keys = torch.arange(2 * 4 * 1 * 5 * 3, dtype=torch.float64).view(2, 4, 1, 5, 3)  # (layers, N, h, cap, d)
    kv = ops.KVBuffers(keys.clone(), -keys.clone())
    kv.select(torch.tensor([3, 1]), filled=2)
    assert kv.keys.shape == kv.values.shape == (2, 2, 1, 5, 3)
    assert torch.equal(kv.keys[:, :, :, :2], keys[:, [3, 1], :, :2])
    assert torch.equal(kv.values[:, :, :, :2], -keys[:, [3, 1], :, :2])


def test_tree_mask_by_hand():
    """A query attends an earlier-or-same key of its own segment that is on the trunk (branch 0) or
    on the query's own branch; padding (segment -1) attends only itself, and nothing attends it."""
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
    mask = ops.tree_mask(segment, branch)
    assert mask.shape == (2, 1, 7, 7) and mask.dtype == torch.bool
    assert mask[0, 0].int().tolist() == want0 and mask[1, 0].int().tolist() == want1


@pytest.mark.parametrize("model_type,kw", [
    ("gpt2", {}),
    ("mistral", {}),  # MistralConfig's default sliding_window (4096)
    ("qwen2", {"use_sliding_window": True, "sliding_window": 8}),
    ("llama", {"hidden_act": "gelu"}),
    ("llama", {"attention_dropout": 0.1}),
    ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    ("llama", {"auto_map": {"AutoModelForCausalLM": "modeling.MyLlama"}}),
], ids=["gpt2", "mistral-default-window", "qwen2-window", "gelu", "attention-dropout", "dynamic-rope", "remote-code"])
def test_what_it_leaves_to_the_hugging_face_module(model_type, kw):
    from transformers import AutoConfig

    if model_type == "gpt2":
        cfg = AutoConfig.for_model("gpt2", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4)
    else:
        cfg = AutoConfig.for_model(model_type, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, **kw)
    assert D.unsupported(cfg)


def test_load_model_picks_the_module(make_config):
    """The Llama family loads as preftune's module, `model.lean_forward: false` as the Hugging Face
    one; bf16 training keeps float32 masters with bf16 compute, a frozen bf16 model bf16 weights."""
    from transformers import PreTrainedModel

    from preftune.config import ModelConfig
    from preftune.model.load import autocast, compute_dtype, load_model

    assert isinstance(load_model(make_config().model, str(MODEL_DIR)), Llama)
    off = make_config("model.lean_forward=false").model
    assert isinstance(load_model(off, str(MODEL_DIR)), PreTrainedModel)
    assert isinstance(load_model(off, str(MODEL_DIR), trainable=False), PreTrainedModel)
    for lean in (True, False):
        mixed = load_model(ModelConfig(dtype="bfloat16", lean_forward=lean), str(MODEL_DIR))
        assert next(mixed.parameters()).dtype == torch.float32 and compute_dtype(mixed) == torch.bfloat16
        with autocast(mixed):
            assert torch.is_autocast_enabled("cpu")
        frozen = load_model(ModelConfig(dtype="bfloat16", lean_forward=lean), str(MODEL_DIR), trainable=False)
        assert next(frozen.parameters()).dtype == torch.bfloat16 and compute_dtype(frozen) is None
    assert load_model(ModelConfig(gradient_checkpointing=True), str(MODEL_DIR)).checkpointing


def test_a_saved_folder_opens_in_transformers(tmp_path):
    """save_pretrained writes what `AutoModelForCausalLM.from_pretrained` reads, tied head and all,
    and `from_pretrained` reads it back to the same weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(MODEL_DIR))
    own = Llama.from_pretrained(MODEL_DIR, config, dtype=torch.float32)
    with torch.no_grad():
        own.model.norm.weight.mul_(1.5)  # changed, so the copy cannot be the original folder's
    own.save_pretrained(tmp_path / "out")
    hf = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))
    again = Llama.from_pretrained(tmp_path / "out", config, dtype=torch.float32)
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = own.logits(own.hidden(ids, torch.arange(9).expand(2, 9)))
        torch.testing.assert_close(hf(input_ids=ids).logits, want, rtol=0, atol=1e-5)  # float32
    assert all(torch.equal(a, b) for a, b in zip(own.state_dict().values(), again.state_dict().values()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_passes_with_and_without_grad_compute_the_same_bits(dtype):
    """The reference pass (no grad) runs the same arithmetic as the training forward (`_RMSNorm`,
    `_Rope`): while the policy still equals the reference, their log-probs agree to the bit."""
    from preftune.model.logps import completion_logps

    _, own = pair("qwen2", dtype)
    g = torch.Generator().manual_seed(5)
    p_ids, c_ids = torch.randint(3, VOCAB, (4, 7), generator=g), torch.randint(3, VOCAB, (4, 9), generator=g)
    masks = torch.ones(4, 7, dtype=torch.long), torch.ones(4, 9, dtype=torch.long)
    with torch.no_grad():
        ref, _ = completion_logps(own, p_ids, masks[0], c_ids, masks[1])
    policy, _ = completion_logps(own, p_ids, masks[0], c_ids, masks[1])
    assert policy.requires_grad and torch.equal(policy.detach(), ref)


@pytest.mark.parametrize("arch", ["qwen2", "glm4", "qwen3-moe"])
def test_lora_on_the_own_module_equals_peft_on_the_hugging_face_module(tmp_path, arch):
    """The same adapters (PEFT, all linear layers but the head; GLM-4's fused gate_up_proj is one
    target) on both modules: the same logits and adapter gradients, adapters saved under the same
    names, and the step's merged weights decode as the adapted module does."""
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model

    from preftune.config import ModelConfig
    from preftune.model.load import _wrap_lora

    hf, own = pair(arch)
    lora = ModelConfig().lora
    lora.enabled, lora.r, lora.alpha = True, 4, 8
    # on a mixture of experts PEFT wraps the router and the 3-D experts (also for a list naming
    # down_proj), which the own module leaves out: the attention projections there
    targets = ["q_proj", "k_proj", "v_proj", "o_proj"] if "moe" in arch else "all-linear"
    lora.target_modules = targets
    want_model = get_peft_model(hf, LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    got_model = _wrap_lora(own, ModelConfig(lora=lora), "base")
    with torch.no_grad():  # the same non-zero B matrices, so the adapters change the output
        for (n, a), (m, b) in zip(sorted(want_model.named_parameters()), sorted(got_model.named_parameters())):
            if "lora_" in n:
                assert n == m  # the same names: PEFT's adapter files of the two modules agree
                a.normal_(0, 0.1, generator=torch.Generator().manual_seed(len(n)))
                b.copy_(a)
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(8).expand(2, 8)
    want = want_model(input_ids=ids).logits
    want.square().sum().backward()
    base = got_model.get_base_model()
    got = base.logits(base.hidden(ids, pos))
    got.square().sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    wg = {n: p.grad for n, p in want_model.named_parameters() if p.grad is not None}
    gg = {n: p.grad for n, p in got_model.named_parameters() if p.grad is not None}
    adapted = [n for n, m in hf.named_modules() if n.split(".")[-1] in type(own).PROJECTIONS and hasattr(m, "lora_A")]
    assert len(wg) == 2 * len(adapted) and wg.keys() == gg.keys()  # A and B of each
    for k in wg:
        torch.testing.assert_close(gg[k], wg[k], rtol=0, atol=1e-10 * wg[k].abs().max().item())
    want_model.save_pretrained(str(tmp_path / "hf"))
    got_model.save_pretrained(str(tmp_path / "own"))
    from safetensors.torch import load_file

    assert load_file(str(tmp_path / "hf" / "adapter_model.safetensors")).keys() == \
        load_file(str(tmp_path / "own" / "adapter_model.safetensors")).keys()
    with torch.no_grad():  # the decode step on merged weights: the adapted module's last-token logits
        kv = base.new_kv(2, 8, torch.float64)
        base.hidden(ids[:, :7], pos[:, :7], kv=kv)
        cos, sin = base.rope(pos[:, 7:])
        step = base.step(ids[:, 7], cos[:, 0, 0], sin[:, 0, 0], torch.ones(2, 8, dtype=torch.bool), kv, 7,
                         base.decoding(torch.float64))
    torch.testing.assert_close(step, want[:, 7].detach(), rtol=0, atol=1e-9)
