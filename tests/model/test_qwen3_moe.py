"""Qwen3-MoE in the own module, beyond the per-architecture equality tests it shares with the
Llama family (tests/model/test_llama.py, test_logps.py): the router by hand, the grouped experts
against a per-token sum, both checkpoint layouts in, the transformers-5 layout out."""
from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from preftune.model import qwen3_moe as M
from preftune.model.families import own_class
from tests.conftest import MODEL_DIR
from tests.model.test_llama import ARCHS, VOCAB, tiny


def test_route_by_hand():
    """Softmax in float32 over all experts, the top k, renormalised only with norm_topk_prob."""
    logits = torch.log(torch.tensor([[0.1, 0.2, 0.3, 0.4]], dtype=torch.float64))  # softmax = these
    w, e = M.route(logits, 2, renormalise=False)
    assert e.tolist() == [[3, 2]] and w.dtype == torch.float64
    torch.testing.assert_close(w, torch.tensor([[0.4, 0.3]], dtype=torch.float64), rtol=0, atol=1e-7)
    w, _ = M.route(logits, 2, renormalise=True)
    torch.testing.assert_close(w, torch.tensor([[4 / 7, 3 / 7]], dtype=torch.float64), rtol=0, atol=1e-7)


def test_grouped_experts_is_the_per_token_sum_with_one_matmul_pair_per_expert(monkeypatch):
    g = torch.Generator().manual_seed(0)
    N, H, inter, E, k = 9, 6, 5, 4, 2
    x = torch.randn(N, H, generator=g, dtype=torch.float64)
    gate_up, down = torch.randn(E, 2 * inter, H, generator=g, dtype=torch.float64), \
        torch.randn(E, H, inter, generator=g, dtype=torch.float64)
    experts = torch.stack([torch.randperm(3, generator=g)[:k] for _ in range(N)])  # expert 3 never chosen
    weights = torch.rand(N, k, generator=g, dtype=torch.float64)
    want = torch.zeros(N, H, dtype=torch.float64)
    for t in range(N):
        for j in range(k):
            e = int(experts[t, j])
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            want[t] += weights[t, j] * (down[e] @ (F.silu(gate) * up))
    calls = []
    linear = F.linear
    monkeypatch.setattr(M.F, "linear", lambda *a: calls.append(1) or linear(*a))
    got = M.grouped_experts(x, experts, weights, gate_up, down)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert len(calls) == 2 * 3  # two matmuls per expert that has tokens, none for the idle one


def _folder(tmp_path, per_expert: bool):
    """A tiny random Qwen3-MoE folder (float32) with the example tokenizer; `per_expert`: the
    weights in the layout before transformers 5 (one module per expert)."""
    from safetensors.torch import save_file

    model_type, kw = ARCHS["qwen3-moe"]
    hf = tiny(model_type, dtype=torch.float32, **kw)
    out = tmp_path / ("old" if per_expert else "new")
    hf.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, out / name)
    if per_expert:
        state = {}
        for name, t in hf.state_dict().items():
            if name.endswith("experts.gate_up_proj"):
                for e, w in enumerate(t):
                    gate, up = w.chunk(2)
                    stem = name.removesuffix("gate_up_proj") + str(e)
                    state[f"{stem}.gate_proj.weight"], state[f"{stem}.up_proj.weight"] = gate.clone(), up.clone()
            elif name.endswith("experts.down_proj"):
                for e, w in enumerate(t):
                    state[name.removesuffix("down_proj") + f"{e}.down_proj.weight"] = w.clone()
            else:
                state[name] = t.clone()
        for f in out.glob("*.safetensors"):
            f.unlink()
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    return hf, out


@pytest.mark.parametrize("per_expert", [False, True], ids=["fused-3d", "per-expert"])
def test_both_expert_layouts_load_and_saves_are_the_transformers_5_layout(tmp_path, per_expert):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from preftune.config import ModelConfig
    from preftune.model.load import load_model

    hf, folder = _folder(tmp_path, per_expert)
    own = load_model(ModelConfig(), str(folder))
    assert isinstance(own, M.Qwen3Moe) and own_class(hf.config) is M.Qwen3Moe
    assert all(torch.equal(own.state_dict()[k], v) for k, v in hf.state_dict().items())
    own.save_pretrained(tmp_path / "saved")
    saved = load_file(str(tmp_path / "saved" / "model.safetensors"))
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)
    assert not any(".experts.0." in k for k in saved)
    again = AutoModelForCausalLM.from_pretrained(str(tmp_path / "saved"), experts_implementation="eager")
    ids = torch.randint(3, VOCAB, (2, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        torch.testing.assert_close(again(input_ids=ids).logits, want, rtol=0, atol=1e-5)
        torch.testing.assert_close(own.logits(own.hidden(ids, torch.arange(7).expand(2, 7))), want, rtol=0, atol=1e-5)


def test_a_checkpoint_missing_an_expert_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    hf, folder = _folder(tmp_path, per_expert=True)
    state = load_file(str(folder / "model.safetensors"))
    state = {k: v for k, v in state.items() if ".experts.3." not in k}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(KeyError, match="experts"):
        M.Qwen3Moe.from_pretrained(folder, hf.config, dtype=torch.float32)


def test_lora_all_linear_adapts_the_attention_and_samples():
    """LoRA's "all-linear" on the own Qwen3-MoE: the attention projections (PEFT would move MLP
    targets onto the 3-D experts, which the sampler's fused decode weights cannot read); naming an
    MLP projection is one clear error."""
    pytest.importorskip("peft")
    from preftune.config import ModelConfig
    from preftune.errors import UserError
    from preftune.model.load import _wrap_lora
    from preftune.rollout.sampler import sample
    from tests.model.test_llama import pair

    _, own = pair("qwen3-moe-sparse-step")
    cfg = ModelConfig()
    cfg.lora.enabled = True
    model = _wrap_lora(own, cfg, "base")
    adapted = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj"}
    ro = sample(model, torch.tensor([[5, 6, 7]]), torch.ones(1, 3, dtype=torch.long), num_generations=2,
                max_new_tokens=3, eos_id=1, pad_id=0, generator=torch.Generator().manual_seed(0))
    assert ro.completion_ids.shape[0] == 2
    _, other = pair("qwen3-moe-sparse-step")
    cfg.lora.target_modules = ["q_proj", "gate_proj", "up_proj", "down_proj"]
    with pytest.raises(UserError, match="3-D experts") as e:
        _wrap_lora(other, cfg, "base")
    assert e.value.where == "model.lora.target_modules"


@pytest.mark.parametrize("arch", ["qwen3-moe", "qwen3-moe-per-expert", "glm4", "llama-yarn", "qwen2-tied"])
def test_the_sliced_reader_fills_a_meta_model_as_the_whole_load_does(tmp_path, arch):
    """distributed/weights.py in one process: a model built on the meta device, given storage and
    filled tensor by tensor from the files (rotary tables recomputed), equals load_model's bit for
    bit, per-expert Qwen3-MoE checkpoints (as transformers saves them) included: each rank stacks
    its own experts from their modules (`Qwen3Moe.stored_layout`, `read_stored`)."""
    from preftune.config import ModelConfig
    from preftune.distributed import weights
    from preftune.model.hf_files import stored
    from preftune.model.load import load_model

    if arch.startswith("qwen3-moe"):  # transformers saves one module per expert, the own module 3-D
        _, folder = _folder(tmp_path, per_expert=True)
        if arch == "qwen3-moe":
            load_model(ModelConfig(), str(folder)).save_pretrained(tmp_path / "3d")
            folder = tmp_path / "3d"
    else:
        model_type, kw = ARCHS[arch]
        folder = tmp_path / arch
        tiny(model_type, dtype=torch.float32, **kw).save_pretrained(folder)
    cfg = ModelConfig(dtype="bfloat16")  # float32 masters read from float32 files
    whole = load_model(cfg, str(folder))
    meta = load_model(cfg, str(folder), weights=False)
    meta.to_empty(device="cpu")
    if meta.tied:  # to_empty gives each name its own tensor; FSDP2 keeps a shared parameter shared
        meta.lm_head.weight = meta.model.embed_tokens.weight
    assert weights.sliceable(meta, stored(folder)) is None
    weights.read_shards(meta, stored(folder))
    meta.fill_buffers()
    a, b = dict(meta.named_parameters()), dict(whole.named_parameters())
    assert a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)
    assert all(torch.equal(x, y) for x, y in zip(meta.buffers(), whole.buffers(), strict=True))
