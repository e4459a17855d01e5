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
from preftune.errors import UserError
from tests.conftest import MODEL_DIR, TRAIN_PROMPTS, arith_traces

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


# ------------------------------------------------------------------ finding 4: TRL's objects


def saved_config(out: Path) -> dict:
    import yaml

    return yaml.safe_load((out / "config.yaml").read_text())


def test_peft_lora_config_as_peft_config_and_as_model_lora(tmp_path, model_dir):
    from peft import LoraConfig

    lora = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    preftune.train({}, overrides=tiny(tmp_path, model_dir, max_steps=1), train_data=PROMPTS, peft_config=lora)
    want = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
    assert saved_config(tmp_path / "run")["model"]["lora"] == want
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
    cfg = preftune.load_config({"model": {"lora": lora}, "data": {"train": str(TRAIN_PROMPTS)}})
    assert (cfg.model.lora.enabled, cfg.model.lora.r, cfg.model.lora.alpha) == (True, 4, 8)
    with pytest.raises(UserError, match=r"^peft_config.use_dora: True cannot be honoured"):
        preftune.train({}, overrides=tiny(tmp_path, model_dir, "dora"), train_data=PROMPTS,
                       peft_config=LoraConfig(r=4, target_modules="all-linear", use_dora=True))
    with pytest.raises(UserError, match=r"^peft_config.target_modules: None lets PEFT pick"):
        preftune.train({}, overrides=tiny(tmp_path, model_dir, "none"), train_data=PROMPTS,
                       peft_config=LoraConfig(r=4))
    assert not (tmp_path / "dora").exists() and not (tmp_path / "none").exists()


class Recorder:
    """A transformers TrainerCallback that records its events and stops after global step 2."""

    def __new__(cls, *args, **kwargs):
        from transformers import TrainerCallback

        class _Recorder(TrainerCallback):
            def __init__(self):
                self.events = []

            def on_train_begin(self, args, state, control, **kw):
                self.events.append(("train_begin", state.global_step))

            def on_step_end(self, args, state, control, **kw):
                assert args.output_dir and "model" in kw and "optimizer" in kw
                self.events.append(("step_end", state.global_step))
                if state.global_step == 2:
                    control.should_training_stop = True
                return control

            def on_log(self, args, state, control, logs=None, **kw):
                self.events.append(("log", state.global_step, "loss" in logs or "eval/reward" in logs))

            def on_evaluate(self, args, state, control, metrics=None, **kw):
                self.events.append(("evaluate", state.global_step, "eval/reward" in metrics))

            def on_save(self, args, state, control, **kw):
                self.events.append(("save", state.global_step))

            def on_train_end(self, args, state, control, **kw):
                self.events.append(("train_end", state.global_step, len(state.log_history)))

        return _Recorder()


def test_trainer_callbacks_get_the_trainers_events_and_can_stop(tmp_path, model_dir):
    rec = Recorder()
    result = preftune.train({}, overrides=tiny(tmp_path, model_dir, max_steps=5, save_steps=1), train_data=PROMPTS,
                            eval_data=PROMPTS[:2], callbacks=[rec])
    assert result.stopped_early and result.step == 2
    assert rec.events == [("train_begin", 0), ("log", 0, True), ("evaluate", 0, True),
                          ("step_end", 1), ("log", 1, True), ("save", 1),
                          ("step_end", 2), ("log", 2, True), ("save", 2),
                          ("log", 2, True), ("evaluate", 2, True), ("train_end", 2, 4)]


@pytest.mark.parametrize("bad", [42, "stop_when_good", object()])
def test_a_callback_that_is_neither_is_refused_at_the_start(tmp_path, model_dir, bad):
    with pytest.raises(UserError, match=r"^callbacks\[1\]: a \w+ is neither a function"):
        preftune.train({}, overrides=tiny(tmp_path, model_dir), train_data=PROMPTS,
                       callbacks=[lambda step, m: None, bad])
    assert not (tmp_path / "run").exists()


def brevity(prompts, completions, completion_ids, **columns):
    return [1.0 - len(ids) / 4 for ids in completion_ids]


def test_a_trl_grpo_config_is_translated_with_trls_defaults(tmp_path, model_dir, capsys):
    from trl import GRPOConfig

    args = GRPOConfig(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4, num_generations=4,
                      max_completion_length=3, learning_rate=1e-3, logging_steps=1, beta=0.02, bf16=False,
                      use_cpu=True, report_to="none", save_strategy="no", lr_scheduler_type="constant",
                      logging_first_step=True)
    result = preftune.train(args, model=str(model_dir), reward_funcs=[brevity], train_data=PROMPTS,
                            overrides={"data.max_prompt_length": 16, "log.progress_bar": False})
    assert result.step == 2
    saved = saved_config(tmp_path / "run")
    assert saved["algorithm"] == "grpo" and saved["max_steps"] == 2 and saved["save_steps"] == 0
    assert saved["seed"] == 42  # TRL's default seed, not preftune's 0
    assert saved["grpo"].items() >= {"num_generations": 4, "prompts_per_step": 1, "micro_batch_size": 4,
                                  "max_completion_length": 3, "beta": 0.02, "loss_type": "dapo",
                                  "use_bias_correction_kl": True, "scale_rewards": "group"}.items()
    assert saved["optim"]["lr"] == 1e-3 and saved["optim"]["lr_scheduler"] == "constant"
    assert saved["model"]["gradient_checkpointing"] is True and saved["model"]["dtype"] == "float32"
    assert saved["log"]["logging_steps"] == 1 and saved["log"]["report_to"] == []
    printed = capsys.readouterr().out
    assert "TRL GRPOConfig -> preftune config (algorithm: grpo)" in printed
    assert any(line.split()[:3] == ["named", "differently", "learning_rate"] and "optim.lr" in line
               for line in printed.splitlines())
    assert any(line.split()[:2] == ["mapped", "num_generations"] for line in printed.splitlines())
    assert any(line.split()[:2] == ["ignored", "logging_first_step"] for line in printed.splitlines())


def test_trl_configs_that_cannot_be_honoured(tmp_path):
    from trl import GRPOConfig

    common = dict(output_dir=str(tmp_path / "run"), bf16=False, use_cpu=True)
    with pytest.raises(UserError, match=r"^TRL GRPOConfig.max_steps: -1: TRL then trains num_train_epochs"):
        preftune.train(GRPOConfig(**common), train_data=PROMPTS)
    with pytest.raises(UserError, match=r"^TRL GRPOConfig.min_p: 0.1 cannot be honoured"):
        preftune.train(GRPOConfig(max_steps=2, min_p=0.1, **common), train_data=PROMPTS)
    with pytest.raises(UserError, match=r"^TRL GRPOConfig.steps_per_generation: 2 optimiser micro-steps"):
        preftune.train(GRPOConfig(max_steps=2, steps_per_generation=2, **common), train_data=PROMPTS)
    with pytest.raises(UserError, match=r"^TRL GRPOConfig.save_strategy: 'epoch' cannot be honoured"):
        preftune.train(GRPOConfig(max_steps=2, save_strategy="epoch", **common), train_data=PROMPTS)
    assert not (tmp_path / "run").exists()


def test_trl_dpo_kto_and_sft_configs(tmp_path, model_dir):
    from trl import DPOConfig, KTOConfig, SFTConfig

    common = dict(bf16=False, use_cpu=True, max_steps=1, per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  max_length=64, report_to="none", save_strategy="no", disable_tqdm=True)
    traces = arith_traces()
    result = preftune.train(DPOConfig(output_dir=str(tmp_path / "dpo"), beta=0.2, **common), model=str(model_dir),
                            train_data=traces)
    saved = saved_config(tmp_path / "dpo")
    assert result.step == 1 and saved["algorithm"] == "dpo"
    assert saved["dpo"].items() >= {"beta": 0.2, "batch_size": 4, "micro_batch_size": 2, "max_length": 64,
                                 "loss_type": ["sigmoid"], "precompute_ref_logps": False}.items()
    kto = preftune.load_config(KTOConfig(output_dir=str(tmp_path / "kto"), desirable_weight=1.5, **common),
                               [f"data.train={TRAIN_PROMPTS}"])
    assert (kto.algorithm, kto.kto.desirable_weight, kto.kto.batch_size, kto.kto.max_length) == ("kto", 1.5, 4, 64)
    sft = preftune.load_config(SFTConfig(output_dir=str(tmp_path / "sft"), learning_rate=3e-5, **common),
                               [f"data.train={TRAIN_PROMPTS}"])
    assert (sft.algorithm, sft.optim.lr, sft.sft.packing, sft.sft.batch_size) == ("sft", 3e-5, False, 4)


def test_preftunes_own_sections_as_the_config(tmp_path, model_dir):
    result = preftune.train(preftune.DPOConfig(beta=0.2, batch_size=4, micro_batch_size=4), train_data=arith_traces(),
                            overrides={**tiny(tmp_path, model_dir, max_steps=1), "dpo.max_length": 64})
    saved = saved_config(tmp_path / "run")
    assert result.step == 1 and saved["algorithm"] == "dpo" and saved["dpo"]["beta"] == 0.2
    with pytest.raises(UserError, match=r"^config: a ModelConfig is one section of a config"):
        preftune.train(preftune.ModelConfig(), train_data=PROMPTS)
    with pytest.raises(UserError, match=r"^config: expected a YAML path, a dict, .* got a int"):
        preftune.train(3, train_data=PROMPTS)


def test_a_loaded_model_object(tmp_path, model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    first = preftune.train({}, overrides=tiny(tmp_path, None, max_steps=1, save_steps=1), model=model,
                           train_data=PROMPTS)
    out = tmp_path / "run"
    assert saved_config(out)["model"]["name_or_path"] == str(out / "base_model") and first.step == 1
    assert (out / "base_model" / "tokenizer.json").is_file()  # read from the folder the model came from
    again = preftune.train({}, overrides=tiny(tmp_path, None, max_steps=2, save_steps=1), model=model,
                           train_data=PROMPTS)  # the same object: the run resumes
    assert again.step == 2 and [r["step"] for r in records(out) if "loss" in r] == [1, 2]
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    with pytest.raises(UserError, match=r"^model: .*base_model holds another model than the one passed"):
        preftune.train({}, overrides=tiny(tmp_path, None, max_steps=3), model=model, train_data=PROMPTS)
    with pytest.raises(UserError, match=r"^model: a int is neither a model folder nor a transformers model"):
        preftune.train({}, overrides=tiny(tmp_path, None, "other"), model=3, train_data=PROMPTS)


def test_a_model_object_under_torchrun_is_refused_by_every_rank(tmp_path, model_dir, monkeypatch):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir))
    monkeypatch.setenv("WORLD_SIZE", "2")  # each rank would write OUTPUT_DIR/base_model at once
    with pytest.raises(UserError, match=r"^model: a model object under torchrun"):
        preftune.train({}, overrides=tiny(tmp_path, None), model=model, train_data=PROMPTS)
    assert not (tmp_path / "run").exists()


def test_the_migration_pages_trl_objects_script_runs(tmp_path, monkeypatch):
    """docs/from-trl.md "Your TRL objects": its script as written, 2 steps, into tmp_path."""
    import re

    text = (MODEL_DIR.parents[1] / "docs" / "from-trl.md").read_text()
    start = text.index("## Your TRL objects")
    end = text.find("\n## ", start + 1)
    (code,) = re.findall(r"```python\n(.*?)```", text[start:end if end > 0 else None], flags=re.S)
    code = code.replace("max_steps=20", "max_steps=2").replace("runs/", f"{tmp_path}/")
    monkeypatch.chdir(MODEL_DIR.parents[1])
    namespace: dict = {}
    exec(compile(code, "docs/from-trl.md", "exec"), namespace)
    result = namespace["result"]
    assert result.step == 2 and result.model_path.is_dir() and result.metrics["custom/longest"] >= 1
    assert (tmp_path / "from-trl" / "base_model" / "config.json").is_file()
