"""Whole runs on the embedded tiny model: online GRPO (metrics, eval, checkpoints, TensorBoard), LoRA,
bfloat16, chat prompts, prompt truncation, offline GRPO and DPO. Each run is a few steps."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from preftune.config import load_config, to_dict
from preftune.model.load import base_module
from preftune.errors import UserError
from preftune.run.loop import Run, train
from preftune.distributed.group import Parallel
from tests.conftest import EVAL_PROMPTS, MODEL_DIR, write_jsonl

TRAIN_KEYS = ("step", "loss", "reward", "reward_std", "rewards/accuracy/mean", "kl", "completions/mean_length",
              "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "entropy",
              "frac_reward_zero_std", "learning_rate", "grad_norm", "step_time", "tokens_per_second",
              "rewards/accuracy/std", "reward_group_std", "completions/min_length", "completions/max_length",
              "completions/clipped_ratio", "num_tokens")


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_records(out: Path) -> list[dict]:
    return [r for r in records(out) if "loss" in r]


def eval_records(out: Path) -> list[dict]:
    return [r for r in records(out) if "eval/reward" in r]


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float().clone() for k, v in model.state_dict().items()}


@pytest.fixture
def small_eval(tmp_path) -> Path:
    rows = [json.loads(line) for line in EVAL_PROMPTS.read_text().splitlines()[:6]]
    return write_jsonl(tmp_path / "eval.jsonl", rows)


def test_online_grpo_run(make_config, small_eval):
    cfg = make_config("max_steps=4", "save_steps=2", "eval.eval_steps=2", f"data.eval={small_eval}",
                      "grpo.beta=0.04", "log.report_to=[tensorboard]", "grpo.loss_type=grpo",
                      "optim.lr_scheduler=constant")
    run = Run(cfg, dp=Parallel())
    final = run.run()
    out = Path(cfg.output_dir)
    assert final == out / "final"
    # the resolved config is written and reloads to the same config
    assert to_dict(load_config(out / "config.yaml")) == to_dict(cfg)
    steps = train_records(out)
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    for r in steps:
        missing = [k for k in TRAIN_KEYS if k not in r]
        assert not missing, missing
        assert all(math.isfinite(r[k]) for k in TRAIN_KEYS), r
        assert 0.0 <= r["reward"] <= 1.0 and r["kl"] >= 0 and r["learning_rate"] == cfg.optim.lr
        assert 1 <= r["completions/mean_length"] <= cfg.grpo.max_completion_length
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference at step 1
    # eval before the first step, at eval_steps, and after the last (not twice at step 4)
    evals = eval_records(out)
    assert [r["step"] for r in evals] == [0, 2, 4]
    assert records(out)[0]["step"] == 0 and all(r["eval/num_prompts"] == 6 for r in evals)
    assert all(0.0 <= r["eval/reward"] <= 1.0 for r in evals)
    # checkpoints and the final model load with plain transformers; final == last trained weights
    for name in ("checkpoints/step-2", "checkpoints/step-4", "final"):
        assert (out / name / "config.json").is_file(), name
    final_model = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32)
    base = weights(AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32))
    now, trained = weights(final_model), weights(run.model)
    assert all(torch.equal(now[k], trained[k]) for k in trained)
    assert any(not torch.equal(now[k], base[k]) for k in base)  # it did train
    step4 = weights(AutoModelForCausalLM.from_pretrained(str(out / "checkpoints/step-4"), dtype=torch.float32))
    assert all(torch.equal(step4[k], now[k]) for k in now)
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    assert json.loads((out / "data_report.json").read_text()) == {"prompts": 300}


def test_lora_run_saves_a_merged_model(make_config, tokenizer):
    pytest.importorskip("peft")
    cfg = make_config("model.lora.enabled=true", "model.lora.r=4", "optim.lr=2e-2", "save_steps=2")
    run = Run(cfg, dp=Parallel())
    final = run.run()
    assert hasattr(run.model, "peft_config")
    trainable = sum(p.numel() for p in run.model.parameters() if p.requires_grad)
    assert 0 < trainable < sum(p.numel() for p in run.model.parameters()) / 5  # only the adapters train
    merged = AutoModelForCausalLM.from_pretrained(str(final), dtype=torch.float32)
    assert not any("lora" in k for k in merged.state_dict())
    ids = torch.tensor([tokenizer("12+7=").input_ids])
    with torch.no_grad():
        own = base_module(run.model)  # preftune's module under PEFT's adapters: hidden states, then its head
        want = own.logits(run.model(ids, torch.arange(ids.size(1))[None]))
        got = merged(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32)(input_ids=ids).logits
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # merge is exact (up to float error)
    assert not torch.allclose(got, base, atol=1e-4)  # and the adapters learned something
    assert (Path(cfg.output_dir) / "checkpoints/step-2/adapter/adapter_model.safetensors").is_file()


def test_lora_kl_uses_the_base_under_the_adapters(make_config):
    """With LoRA, beta > 0 needs no second model: the reference is the policy with adapters off."""
    pytest.importorskip("peft")
    cfg = make_config("model.lora.enabled=true", "model.lora.r=4", "optim.lr=5e-2", "grpo.beta=0.1", "max_steps=3")
    run = Run(cfg, dp=Parallel())
    assert run.task.ref_model is run.model
    run.run()
    steps = train_records(Path(cfg.output_dir))
    assert steps[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # LoRA B starts at 0: policy == base
    assert steps[-1]["kl"] > 1e-6  # the adapters moved the policy away from the base


def test_bfloat16_run(make_config):
    cfg = make_config("model.dtype=bfloat16", "max_steps=1")
    final = train(cfg)
    (r,) = train_records(Path(cfg.output_dir))
    assert math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"])
    assert json.loads((final / "config.json").read_text())["dtype"] == "bfloat16"
    assert next(AutoModelForCausalLM.from_pretrained(str(final)).parameters()).dtype == torch.bfloat16


def test_bfloat16_full_finetune_keeps_small_updates(make_config):
    """Pure bf16 AdamW would round a 1e-6 step away; float32 master weights under autocast keep it."""
    cfg = make_config("model.dtype=bfloat16", "max_steps=1", "optim.lr=1e-6", "optim.lr_scheduler=constant")
    run = Run(cfg, dp=Parallel())
    assert next(run.model.parameters()).dtype == torch.float32
    run.run()
    base = weights(AutoModelForCausalLM.from_pretrained(str(MODEL_DIR), dtype=torch.float32))
    now = weights(run.model)
    changed = sum(int((now[k] != base[k]).sum()) for k in base if k in now)
    assert changed > 0.5 * sum(v.numel() for v in base.values())


def test_chat_message_prompts(make_config, tokenizer, tmp_path):
    from preftune.data.prompts import load_prompts
    from preftune.data.tokenize import PromptTruncation
    from preftune.rollout.online import encode_prompts

    rows = [{"input": [{"role": "system", "content": "Add."}, {"role": "user", "content": f"{a}+{a}="}],
             "answer": str(2 * a)} for a in range(4)]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    prompts, _, ids = encode_prompts(tokenizer, load_prompts(str(path)), [1], PromptTruncation(16))
    # the template renders the contents (system then user); no special tokens are added on top
    assert ids == [tokenizer("Add.1+1=").input_ids] and prompts[0][1]["content"] == "1+1="
    # a reward that checks it gets chat-form prompts and completions, as TRL passes them
    (tmp_path / "chat_reward.py").write_text(
        "def chat_shape(prompts, completions, answer, **kw):\n"
        "    assert all(isinstance(p, list) and p[-1]['role'] == 'user' for p in prompts)\n"
        "    assert all(c[0]['role'] == 'assistant' and isinstance(c[0]['content'], str) for c in completions)\n"
        "    return [1.0 if c[0]['content'].strip() == a else 0.0 for c, a in zip(completions, answer)]\n")
    cfg = make_config(f"data.train={path}", f"data.eval={path}", "max_steps=1", "data.max_prompt_length=12",
                      f"grpo.reward_funcs=[{tmp_path / 'chat_reward.py'}:chat_shape, accuracy]")
    train(cfg)
    (r,) = train_records(Path(cfg.output_dir))
    assert "rewards/chat_shape/mean" in r and r["rewards/chat_shape/mean"] == r["rewards/accuracy/mean"]
    assert r["prompts_truncated"] == 0
    assert [e["step"] for e in eval_records(Path(cfg.output_dir))] == [0, 1]


# ---------------------------------------------------------------- prompt truncation


@pytest.fixture
def mixed_prompts(tmp_path) -> Path:
    """Two prompts of 4 tokens and two of 6; with max_prompt_length=5 the long ones are over."""
    rows = [{"input": p, "answer": "0"} for p in ("1+2=", "12+17=", "3+4=", "15+11=")]
    return write_jsonl(tmp_path / "mixed.jsonl", rows)


class _Stop:
    def check(self):
        pass


def test_prompt_truncation_left_counted_in_metrics(make_config, mixed_prompts):
    cfg = make_config(f"data.train={mixed_prompts}", "data.max_prompt_length=5", "grpo.prompts_per_step=4",
                      "max_steps=2", "grpo.num_generations=2")
    train(cfg)
    r1, r2 = train_records(Path(cfg.output_dir))
    assert r1["prompts_truncated"] == 2 and r1["prompts_dropped"] == 0
    assert r2["prompts_truncated"] == 2  # each prompt counted once, even when drawn again


def test_prompt_truncation_drop_and_error(make_config, mixed_prompts, model, tokenizer):
    from preftune.algorithms.grpo import GRPOTask

    cfg = make_config(f"data.train={mixed_prompts}", "data.max_prompt_length=5", "grpo.prompts_per_step=4",
                      "data.prompt_truncation=drop", "grpo.num_generations=2")
    task = GRPOTask(cfg, model, tokenizer, torch.device("cpu"), dp=Parallel())
    m = task.step(model, 1, _Stop())
    assert m["prompts_dropped"] == 2 and m["prompts_truncated"] == 0
    assert len(task.pending.advantages) == 2 * 2  # two prompts survive, G=2 each
    err = make_config(f"data.train={mixed_prompts}", "data.max_prompt_length=5", "grpo.prompts_per_step=4",
                      "data.prompt_truncation=error", "grpo.num_generations=2")
    with pytest.raises(UserError, match=r"prompt \d+ has 6 tokens > data.max_prompt_length=5"):
        GRPOTask(err, model, tokenizer, torch.device("cpu"), dp=Parallel())  # at start-up, before any step
    # when no prompt fits at all, drop is a clear config error, not a crash
    none_fit = make_config(f"data.train={mixed_prompts}", "data.max_prompt_length=3", "grpo.prompts_per_step=2",
                           "data.prompt_truncation=drop", "grpo.num_generations=2")
    with pytest.raises(UserError, match="data.max_prompt_length"):
        GRPOTask(none_fit, model, tokenizer, torch.device("cpu"), dp=Parallel()).step(model, 1, _Stop())


# ---------------------------------------------------------------- offline GRPO and DPO


def test_offline_grpo_run(make_config, traces_file):
    cfg = make_config("grpo.rollout=offline", f"data.train={traces_file}", "max_steps=2", "grpo.loss_type=bnpo")
    final = train(cfg)
    out = Path(cfg.output_dir)
    steps = train_records(out)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert "rewards/final_reward/mean" in r and math.isfinite(r["loss"]) and r["grad_norm"] > 0
        assert r["frac_reward_zero_std"] == 0.0  # flat groups are left out when groups are built
    report = json.loads((out / "data_report.json").read_text())
    assert report["groups"]["groups_made"] == 6 and report["traces"]["kept"] == 24
    AutoModelForCausalLM.from_pretrained(str(final))


def test_dpo_run(make_config, traces_file):
    cfg = make_config("algorithm=dpo", f"data.train={traces_file}", "max_steps=2", "dpo.batch_size=4",
                      "dpo.micro_batch_size=2", "save_steps=2")
    final = train(cfg)
    out = Path(cfg.output_dir)
    steps = train_records(out)
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        for k in ("loss", "rewards/accuracies", "rewards/margins", "grad_norm", "learning_rate", "step_time",
                  "tokens_per_second"):
            assert math.isfinite(r[k]), k
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)  # policy == reference at step 1
    assert (out / "ref_logps.pt").is_file() and (out / "checkpoints/step-2/config.json").is_file()
    AutoModelForCausalLM.from_pretrained(str(final))
