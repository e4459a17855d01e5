"""The one packer: every layout it can choose (plain rows; units or single rows packed under a tree
mask) gives the Hugging Face module's per-row log-probs and gradients (float64), and its rule
picks the cheaper layout by multiply-adds."""
import pytest
import torch

from preftune.model import llama as D, logps as L, ops, qwen3_moe
from preftune.model.head import token_logps
from preftune.model.families import own_class
from tests.model.test_llama import ARCHS, VOCAB, grads, tiny

LAYOUTS = {"plain": 1e9, "packed": 0.0}  # logps.MASKED: the cost factor of masked attention


def _batch(seed: int = 0):
    """Rows with left-padded prompts in runs (GRPO groups, a DPO pair, lone rows), completions of
    uneven lengths, one empty."""
    from preftune.data.tensors import left_pad, right_pad

    g = torch.Generator().manual_seed(seed)
    prompts, comps = [], []
    for n, runs in ((9, 3), (4, 2), (6, 1), (2, 1), (11, 4)):
        p = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        for _ in range(runs):
            prompts.append(p)
            comps.append(torch.randint(3, VOCAB, (int(torch.randint(1, 8, (1,), generator=g)),), generator=g).tolist())
    comps[5] = []  # a row with no completion token
    (p_ids, p_mask), (c_ids, c_mask) = left_pad(prompts, 0), right_pad(comps, 0)
    return p_ids, p_mask, c_ids, c_mask, L.Rows.of(prompts, [len(c) for c in comps])


def _reference(hf, p_ids, p_mask, c_ids, c_mask):
    """Each row alone through the Hugging Face module, unpadded."""
    out = torch.zeros(c_ids.shape, dtype=torch.float64)
    for i in range(p_ids.size(0)):
        p, c = p_ids[i][p_mask[i].bool()], c_ids[i][c_mask[i].bool()]
        if len(c):
            logits = hf(input_ids=torch.cat([p, c])[None]).logits[0, len(p) - 1:-1]
            out[i, :len(c)] = logits.log_softmax(-1).gather(1, c[:, None])[:, 0]
    return out


def _router_f64(self, h):
    """transformers' Qwen3-MoE router with its softmax in float64 (not float32)."""
    logits = torch.nn.functional.linear(h.reshape(-1, self.hidden_dim), self.weight)  # (N, E)
    weights, experts = logits.softmax(-1).topk(self.top_k, dim=-1)
    if self.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return logits, weights, experts


def float64_norms(monkeypatch):
    """RMSNorm (and the MoE router's softmax) in the input's dtype, in both modules: HF computes
    them in float32 even for a float64 model, which would cap a comparison of layouts that sum
    gradients in other orders at float32."""
    from transformers.models.glm4 import modeling_glm4
    from transformers.models.qwen2 import modeling_qwen2
    from transformers.models.qwen3 import modeling_qwen3
    from transformers.models.qwen3_moe import modeling_qwen3_moe

    def f64(self, h):
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))

    for cls in (modeling_qwen2.Qwen2RMSNorm, modeling_qwen3.Qwen3RMSNorm, modeling_glm4.Glm4RMSNorm,
                modeling_qwen3_moe.Qwen3MoeRMSNorm):
        monkeypatch.setattr(cls, "forward", f64)
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", _router_f64)
    monkeypatch.setattr(qwen3_moe, "ROUTER_DTYPE", torch.float64)
    monkeypatch.setattr(ops, "rms", lambda x, w, eps: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)))


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "glm4", "qwen3-moe"])
def test_every_layout_gives_the_modules_logps_and_gradients(arch, layout, monkeypatch):
    float64_norms(monkeypatch)
    model_type, kw = ARCHS[arch]
    hf = tiny(model_type, **kw)
    own = own_class(hf.config).of(hf)
    p_ids, p_mask, c_ids, c_mask, rows = _batch()
    w = torch.randn(c_ids.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64) * c_mask
    want = _reference(hf, p_ids, p_mask, c_ids, c_mask)
    (want * w).sum().backward()
    want_grads = grads(hf)
    monkeypatch.setattr(L, "MASKED", LAYOUTS[layout])
    plan = L._plan(rows, p_ids.size(1), c_ids.size(1), own.config)
    assert (plan.segment is None) == (layout == "plain")
    got, entropy = L.completion_logps(own, p_ids, p_mask, c_ids, c_mask, rows=rows, with_entropy=True)
    (got * w).sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-10)
    assert (got[~c_mask.bool()] == 0).all() and entropy.shape == got.shape
    for name, g in grads(own).items():
        torch.testing.assert_close(g, want_grads[name], rtol=0, atol=1e-10 * want_grads[name].abs().max().item())


def test_the_module_path_gives_the_same_logps(hf_model, model):
    """`model.lean_forward: false`: the Hugging Face module over [prompt | completion] rows."""
    p_ids, p_mask, c_ids, c_mask, rows = _batch(1)
    with torch.no_grad():
        a, ea = L.completion_logps(hf_model, p_ids, p_mask, c_ids, c_mask, with_entropy=True)
        b, eb = L.completion_logps(model, p_ids, p_mask, c_ids, c_mask, rows=rows, with_entropy=True)
    torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    torch.testing.assert_close(ea, eb, rtol=0, atol=2e-5)


def test_the_rule_shares_long_prompts_and_packs_uneven_rows():
    config = type("C", (), {"hidden_size": 64, "num_hidden_layers": 2, "intermediate_size": 256})()
    group = L.Rows([200] * 16, [16] * 16, [1] * 16)  # a GRPO group: 200-token prompt, 16 short completions
    plan = L._plan(group, 200, 16, config)
    assert plan.segment is not None and plan.rows * plan.width < 2 * (200 + 16 * 16)  # the prompt once
    even = L.Rows([10] * 8, [10] * 8, list(range(1, 9)))  # no prompt shared, equal lengths: plain rows
    assert L._plan(even, 10, 10, config).segment is None
    uneven = L.Rows([4, 4, 4, 60], [2, 2, 2, 60], [1, 2, 3, 4])  # three short rows fit beside the long one
    plan = L._plan(uneven, 60, 60, config)
    assert plan.segment is not None and plan.rows < 4
    assert L._plan(group, 200, 16, config, pack=False).segment is None  # sft.packing: false


def test_pack_rows_first_fit_decreasing():
    rows, width = L.pack_rows([5, 4, 3, 2, 6], 9)
    assert sorted(map(sorted, rows)) == [[0, 1], [2, 4], [3]] and width == 9
    assert L.pack_rows([9, 1])[0] == [[0], [1]] and L.pack_rows([], 4) == ([], 1)


def test_sliding_window_models_keep_their_window():
    """A sliding-window model takes the HF module's forward with the 2-D mask, so left-padded rows
    keep their window."""
    from transformers import MistralConfig, MistralForCausalLM

    from preftune.data.tensors import positions_from_mask

    torch.manual_seed(0)
    cfg = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, sliding_window=3, attn_implementation="sdpa")
    model = MistralForCausalLM(cfg).eval()
    assert D.unsupported(model.config)
    p_ids, c_ids = torch.randint(3, 64, (2, 6)), torch.randint(3, 64, (2, 5))
    p_mask, c_mask = torch.ones(2, 6, dtype=torch.long), torch.ones(2, 5, dtype=torch.long)
    p_mask[1, :2] = 0  # row 1 left-padded
    with torch.no_grad():
        got, _ = L.completion_logps(model, p_ids, p_mask, c_ids, c_mask)
        ids, attn = torch.cat([p_ids, c_ids], 1), torch.cat([p_mask, c_mask], 1)
        logits = model(input_ids=ids, attention_mask=attn, position_ids=positions_from_mask(attn)).logits.float()
    want, _ = token_logps(logits[:, p_ids.size(1) - 1:-1], c_ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


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
