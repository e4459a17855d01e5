"""A TRL 1.16 user's objects and outputs (issue 36, findings 1-4): what reward functions log, the
trainer_state they see, generation_config.json in every model folder, LoRA adapters that load with
from_pretrained, and TRL's objects handed to preftune.train(): a peft LoraConfig, TrainerCallbacks, TRL
config objects, preftune's own sections, a loaded model."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import preftune
from tests.conftest import MODEL_DIR, TRAIN_PROMPTS

TINY = {"max_steps": 3, "save_steps": 0, "log.progress_bar": False, "grpo.prompts_per_step": 2,
        "grpo.num_generations": 4, "grpo.max_completion_length": 3, "data.max_prompt_length": 16,
        "optim.lr": 1e-3, "optim.lr_scheduler": "constant"}
PROMPTS = [json.loads(line) for line in TRAIN_PROMPTS.read_text().splitlines()[:12]]
# a generation config the embedded model does not have: extra stop ids and sampling defaults
GENERATION = {"eos_token_id": [1, 5], "pad_token_id": 0, "do_sample": True, "temperature": 0.7, "top_p": 0.9}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """The embedded model with its own generation_config.json (stop ids 1 and 5, sampling defaults)."""
    folder = tmp_path / "base"
    shutil.copytree(MODEL_DIR, folder)
    (folder / "generation_config.json").write_text(json.dumps(GENERATION))
    return folder


def tiny(tmp_path, model_dir, name="run", **extra) -> dict:
    model = {"model.name_or_path": str(model_dir)} if model_dir is not None else {}
    return {**TINY, **model, "output_dir": str(tmp_path / name), **extra}


# ------------------------------------------------------------------ finding 1: what reward functions log


def test_reward_functions_log_metrics_and_columns_and_see_trls_global_step(tmp_path, model_dir):
    steps_seen = []

    def difficulty(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, **columns):
        steps_seen.append((trainer_state.global_step, len(prompts)))
        log_metric("custom/mean_difficulty", float(len(prompts)))
        log_metric("custom/step_seen", float(trainer_state.global_step))
        log_extra("difficulty", [len(ids) for ids in completion_ids])
        return [0.0 for _ in completions]

    preftune.train({}, overrides=tiny(tmp_path, model_dir), reward_funcs=[difficulty, "accuracy"], train_data=PROMPTS,
                   eval_data=PROMPTS[:4])
    recs = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["step"] for r in recs] == [1, 2, 3]
    # TRL's global_step counts the steps finished: 0, 1, 2 while steps 1-3 are built (8 completions each),
    # 0 and 3 at the evaluations before and after (4 greedy completions)
    assert steps_seen == [(0, 4), (0, 8), (1, 8), (2, 8), (3, 4)]
    assert [r["custom/mean_difficulty"] for r in recs] == [8.0, 8.0, 8.0]  # 2 prompts x 4 completions a call
    assert [r["custom/step_seen"] for r in recs] == [0.0, 1.0, 2.0]
    assert all(len(r["extra/difficulty"]) == 8 and all(0 <= n <= 3 for n in r["extra/difficulty"]) for r in recs)
    evals = [r for r in records(tmp_path / "run") if "eval/reward" in r]
    assert [(r["step"], r["eval/custom/mean_difficulty"], r["eval/custom/step_seen"]) for r in evals] == [
        (0, 4.0, 0.0), (3, 4.0, 3.0)]
    assert [len(r["eval/extra/difficulty"]) for r in evals] == [4, 4]


def test_log_metric_averages_over_calls_of_one_step(tmp_path, model_dir):
    calls = []

    def twice(prompts, completions, log_metric, **columns):  # two values in one call: their mean is logged
        calls.append(len(calls))
        log_metric("custom/value", float(len(calls)))
        log_metric("custom/value", float(len(calls)) + 1.0)
        return [0.0 for _ in completions]

    preftune.train({}, overrides=tiny(tmp_path, model_dir, max_steps=2), reward_funcs=[twice], train_data=PROMPTS)
    recs = [r for r in records(tmp_path / "run") if "loss" in r]
    assert [r["custom/value"] for r in recs] == [1.5, 2.5]


# ------------------------------------------------------------------ finding 2: generation_config.json


def test_generation_config_reaches_final_checkpoints_and_export(tmp_path, model_dir):
    from preftune.cli.export import export

    preftune.train({}, overrides=tiny(tmp_path, model_dir, max_steps=2, save_steps=1), train_data=PROMPTS)
    out = tmp_path / "run"
    exported = export(out / "checkpoints" / "step-1", tmp_path / "exported")
    for folder in (out / "final", out / "checkpoints" / "step-1", out / "checkpoints" / "step-2", exported):
        saved = json.loads((folder / "generation_config.json").read_text())
        assert {k: saved.get(k) for k in GENERATION} == GENERATION, folder


def test_generation_config_with_the_hugging_face_module(tmp_path, model_dir):
    preftune.train({}, overrides=tiny(tmp_path, model_dir, max_steps=1, **{"model.lean_forward": False}),
                   train_data=PROMPTS)
    saved = json.loads((tmp_path / "run" / "final" / "generation_config.json").read_text())
    assert {k: saved.get(k) for k in GENERATION} == GENERATION


# ------------------------------------------------------------------ finding 3: adapters load with from_pretrained


def test_lora_adapter_folder_loads_with_from_pretrained(tmp_path, model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    preftune.train({}, overrides=tiny(tmp_path, model_dir, max_steps=1, save_steps=1,
                                      **{"model.lora.enabled": True, "model.lora.r": 4}), train_data=PROMPTS)
    adapter = tmp_path / "run" / "checkpoints" / "step-1" / "adapter"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(model_dir)
    loaded = AutoModelForCausalLM.from_pretrained(str(adapter))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "final"))
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, merged(ids).logits, atol=1e-5, rtol=1e-5)

