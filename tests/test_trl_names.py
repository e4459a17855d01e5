"""TRL 1.16's flat names and values in a config (config/trl.py): aliases where the meaning is the
same, the exact preftune key where it is not, on the command line and in YAML."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from preftune.config import Config, load_config, to_yaml
from preftune.config.fields import keys
from preftune.config.trl import ALGORITHMS, rows, trl_key
from preftune.errors import UserError


@pytest.fixture
def cfg_file(tmp_path) -> Path:
    (tmp_path / "prompts.jsonl").write_text('{"input": "1+1=", "answer": "2"}\n')
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"algorithm": "grpo", "output_dir": str(tmp_path / "out"),
                                    "data": {"train": "prompts.jsonl"}}))
    return path


def _error(path, overrides) -> str:
    with pytest.raises(UserError) as e:
        load_config(path, list(overrides))
    assert "\n" not in str(e.value)
    return str(e.value)


@pytest.mark.parametrize("override, key, value", [
    ("beta=0.1", "grpo.beta", 0.1),
    ("learning_rate=3e-6", "optim.lr", 3e-6),
    ("gradient_checkpointing=true", "model.gradient_checkpointing", True),
    ("logging_steps=5", "log.logging_steps", 5),
    ("grpo.max_prompt_length=128", "data.max_prompt_length", 128),  # TRL < 1.0's left cut, in the wrong section
    ("max_completion_length=64", "grpo.max_completion_length", 64),
    ("lr_scheduler_type=cosine", "optim.lr_scheduler", "cosine"),
    ("lora_r=8", "model.lora.r", 8),
    ("precompute_ref_log_probs=false", "dpo.precompute_ref_logps", False),
    ("bf16=true", "model.dtype", "bfloat16"),
    ("disable_tqdm=true", "log.progress_bar", False),
    ("resume_from_checkpoint=true", "resume", "auto"),
])
def test_a_flat_trl_name_with_the_same_meaning_is_accepted(cfg_file, override, key, value):
    cfg = load_config(cfg_file, [override])
    node = cfg
    for part in key.split("."):
        node = getattr(node, part)
    assert node == value
    assert override.split("=")[0].split(".")[-1] not in yaml.safe_load(to_yaml(cfg))  # written as preftune's


def test_beta_max_length_and_loss_type_are_the_algorithms(cfg_file):
    cfg = load_config(cfg_file, ["algorithm=dpo", "beta=0.3", "max_length=256", "loss_type=ipo"])
    assert (cfg.dpo.beta, cfg.dpo.max_length, cfg.dpo.loss_type) == (0.3, 256, "ipo")
    assert cfg.grpo.beta == Config().grpo.beta  # not the GRPO section's
    cfg = load_config(cfg_file, ["algorithm=kto", "beta=0.2"])
    assert cfg.kto.beta == 0.2 and cfg.dpo.beta == Config().dpo.beta
    msg = _error(cfg_file, ["max_length=256"])  # GRPO has none: the keys that do are named
    assert "dpo.max_length" in msg and "sft.max_length" in msg


def test_flat_trl_names_in_yaml(tmp_path, cfg_file):
    data = yaml.safe_load(cfg_file.read_text())
    data.update({"learning_rate": 1e-5, "beta": 0.04, "num_generations": 4, "report_to": "none",
                 "scale_rewards": False, "logging_steps": 2})
    cfg_file.write_text(yaml.safe_dump(data))
    cfg = load_config(cfg_file)
    assert (cfg.optim.lr, cfg.grpo.beta, cfg.grpo.num_generations) == (1e-5, 0.04, 4)
    assert cfg.log.report_to == [] and cfg.grpo.scale_rewards == "none" and cfg.log.logging_steps == 2


@pytest.mark.parametrize("override, named", [
    ("grpo.generation_batch_size=64", "grpo.prompts_per_step"),
    ("generation_batch_size=64", "grpo.prompts_per_step"),
    ("per_device_train_batch_size=4", "grpo.micro_batch_size"),
    ("gradient_accumulation_steps=4", "grpo.prompts_per_step"),
    ("num_train_epochs=3", "max_steps"),
    ("grpo.vllm_importance_sampling_cap=2.0", "grpo.vllm_importance_sampling_clip_max"),
])
def test_a_trl_name_with_another_meaning_is_answered_with_the_exact_key(cfg_file, override, named):
    msg = _error(cfg_file, [override])
    assert f"'{named}'" in msg and override.split("=")[0] in msg


def test_the_batch_size_hints_follow_the_algorithm(cfg_file):
    assert "'dpo.micro_batch_size'" in _error(cfg_file, ["algorithm=dpo", "per_device_train_batch_size=4"])
    assert "'sft.batch_size'" in _error(cfg_file, ["algorithm=sft", "gradient_accumulation_steps=4"])


def test_a_trl_name_and_its_preftune_key_with_different_values_is_refused(cfg_file):
    msg = _error(cfg_file, ["learning_rate=1e-5", "optim.lr=2e-5"])
    assert msg.startswith("learning_rate:") and "optim.lr" in msg
    assert load_config(cfg_file, ["learning_rate=1e-5", "optim.lr=1e-5"]).optim.lr == 1e-5  # the same: fine


@pytest.mark.parametrize("override, key, value", [
    ("grpo.scale_rewards=true", "scale_rewards", "group"),  # TRL 1.16: True -> "group", False -> "none"
    ("grpo.scale_rewards=false", "scale_rewards", "none"),
])
def test_trl_values_of_scale_rewards(cfg_file, override, key, value):
    assert getattr(load_config(cfg_file, [override]).grpo, key) == value


def test_trl_values_of_report_to_and_resume(cfg_file):
    assert load_config(cfg_file, ["log.report_to=none"]).log.report_to == []
    assert load_config(cfg_file, ["log.report_to=tensorboard"]).log.report_to == ["tensorboard"]
    assert load_config(cfg_file, ["resume=true"]).resume == "auto"
    assert load_config(cfg_file, ["resume=false"]).resume == "never"


def test_the_table_names_only_declared_keys():
    declared = {k for k, _, _ in keys(Config)}
    for name, key, _ in rows():
        for algorithm in ALGORITHMS:
            for k in key.format(algorithm=algorithm).split(" / "):
                target = trl_key(name, algorithm) if "{" in key else k
                assert target is None or target in declared, (name, target)
