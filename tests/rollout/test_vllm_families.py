"""vLLM weight pushes for the GLM-4 and Qwen3-MoE families (rollout/vllm.py, rollout/weights.py),
one engine per family: the engine starts on a random tiny folder A, then the weights of another
random model B (preftune's own module) are pushed; the engine then decodes as the own module does
on B, and its log-probs are the trainer's. Qwen3-MoE's experts go as transformers 5 keeps them
(fused 3-D tensors), which vLLM's loader splits itself."""
from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
import torch

from preftune.model.logps import completion_logps
from preftune.rollout.weights import hf_weights
from tests.conftest import MODEL_DIR, TRAIN_PROMPTS, require_vllm
from tests.model.test_llama import tiny
from tests.rollout.test_vllm import PROMPTS, _completions, _engine_greedy, _ids, _own_greedy, _train

# vLLM's CPU attention takes head sizes from 32 up, so 2 heads of 32 in a hidden size of 64
SHAPE = dict(hidden_size=64, head_dim=32, num_attention_heads=2, num_key_value_heads=1, intermediate_size=128,
             max_position_embeddings=64)
FAMILIES = {  # MoE first: an engine started after a dense one in the same process finds no expert-parallel group
    # 4 experts, top 2, layer 0 sparse, layer 1 dense
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                      mlp_only_layers=[1]),
    "glm4": {},  # fused gate_up_proj, q/k/v biases, post-norms, partial interleaved rotary
}


def _folder(path, model_type: str, seed: int):
    hf = tiny(model_type, dtype=torch.float32, seed=seed, **SHAPE, **FAMILIES[model_type])
    hf.save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / name, path / name)
    return path


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """An engine on folder A of the family, and folder B with other random weights. pytest ends
    one family's tests before it builds the next family's engine."""
    require_vllm()
    from preftune.config import load_config
    from preftune.rollout.vllm import VLLMEngine

    root = tmp_path_factory.mktemp(request.param)
    a, b = _folder(root / "a", request.param, 0), _folder(root / "b", request.param, 1)
    cfg = load_config(None, [f"model.name_or_path={a}", f"data.train={TRAIN_PROMPTS}", "grpo.use_vllm=true",
                             "grpo.vllm_kv_cache_gib=1"])
    return SimpleNamespace(name=request.param, a=a, b=b,
                           engine=VLLMEngine(cfg.grpo, cfg.model, max_model_len=64, seed=0))


def _own(folder, lora_targets=None):
    from preftune.config import ModelConfig
    from preftune.config.schema import LoraConfig
    from preftune.model.load import load_model

    lora = LoraConfig(enabled=True, r=4, target_modules=lora_targets) if lora_targets else LoraConfig()
    return load_model(ModelConfig(lora=lora), str(folder))


def test_a_push_of_other_weights_reaches_the_engine(family, tokenizer):
    engine, own_a, own_b = family.engine, _own(family.a), _own(family.b)
    engine.push(own_a)
    before = _completions(_engine_greedy(engine, tokenizer))
    assert before == _completions(_own_greedy(own_a, tokenizer))  # the engine runs the family as the own module
    want = _completions(_own_greedy(own_b, tokenizer))
    assert want != before
    engine.push(own_b)
    assert _completions(_engine_greedy(engine, tokenizer)) == want
    if family.name == "qwen3_moe":  # the experts went as fused 3-D tensors, not one module per expert
        fused = [n for n, t in hf_weights(own_b) if t.dim() == 3]
        assert fused == [f"model.layers.0.mlp.experts.{p}" for p in ("gate_up_proj", "down_proj")]


def _assert_engine_logps_are_the_trainers(engine, model, tokenizer):
    """Temperature 0.7, top_p 0.9, top_k 5: each drawn token's log-prob is the trainer's for the
    same filtered distribution, as for the Llama family (test_vllm.py)."""
    opts = dict(temperature=0.7, top_p=0.9, top_k=5)
    ro = engine.generate(_ids(tokenizer), list(range(len(PROMPTS))), num_generations=4, max_new_tokens=6,
                         eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, seed=3, **opts)
    with torch.no_grad():
        trainer, _ = completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids, ro.completion_mask,
                                      **opts)
    m = ro.completion_mask.bool()
    assert m.sum() > len(PROMPTS) * 4
    assert (trainer[m] - ro.sampling_logps[m]).abs().max() < 1e-3


def test_behaviour_logps_match_the_trainers_after_a_push(family, tokenizer):
    own_b = _own(family.b)
    family.engine.push(own_b)
    _assert_engine_logps_are_the_trainers(family.engine, own_b, tokenizer)


def test_a_lora_merged_push_reaches_the_engine(family, tokenizer):
    """LoRA merged for the push, and a push after other pushes (the experts packed afresh). GLM-4:
    all-linear (its fused gate_up_proj too). Qwen3-MoE: the attention projections, since PEFT 0.21
    moves its MLP names onto the experts' 3-D parameters, which the own module does not adapt."""
    peft_model = _own(family.b, "all-linear" if family.name == "glm4" else ["q_proj", "k_proj", "v_proj", "o_proj"])
    base = _completions(_own_greedy(peft_model, tokenizer))
    _train(peft_model, tokenizer, steps=6)  # only the adapters move
    tuned = _completions(_own_greedy(peft_model, tokenizer))
    assert tuned != base
    family.engine.push(peft_model)
    assert _completions(_engine_greedy(family.engine, tokenizer)) == tuned
    _assert_engine_logps_are_the_trainers(family.engine, peft_model, tokenizer)
