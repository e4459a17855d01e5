"""Config: YAML load, dotted overrides, unknown keys with a suggestion, type and choice checks, round trip."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import yaml

from preftune.config import CHOICES, Config, GRPOConfig, load_config, to_dict, to_yaml
from preftune.errors import UserError

REQUIRED = ("algorithm", "output_dir", "max_steps", "save_steps", "seed")


@pytest.fixture
def cfg_file(tmp_path) -> Path:
    (tmp_path / "prompts.jsonl").write_text('{"input": "1+1=", "answer": "2"}\n')
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({
        "algorithm": "grpo", "output_dir": str(tmp_path / "out"), "max_steps": 7, "save_steps": 3, "seed": 5,
        "data": {"train": "prompts.jsonl", "max_prompt_length": 32},
        "grpo": {"loss_type": "grpo", "beta": 0.01, "reward_funcs": ["accuracy", "format"]},
        "optim": {"lr": 1e-5},
    }))
    return path


def _error(path, overrides=()) -> str:
    with pytest.raises(UserError) as e:
        load_config(path, list(overrides))
    msg = str(e.value)
    assert "\n" not in msg  # one line for the CLI
    return msg


def test_required_top_level_keys_exist():
    names = {f.name for f in dataclasses.fields(Config)}
    assert set(REQUIRED) <= names
    d = to_dict(Config())
    assert set(REQUIRED) <= set(d) and "config_dir" not in d  # internal field never serialised


def test_yaml_load_sets_values_and_keeps_defaults(cfg_file):
    cfg = load_config(cfg_file)
    assert (cfg.max_steps, cfg.save_steps, cfg.seed) == (7, 3, 5)
    assert cfg.grpo.loss_type == "grpo" and cfg.grpo.beta == 0.01
    assert cfg.grpo.reward_funcs == ["accuracy", "format"]
    assert cfg.optim.lr == 1e-5 and isinstance(cfg.optim.lr, float)
    assert cfg.grpo.num_generations == GRPOConfig().num_generations  # untouched keys keep defaults
    # a relative data path that exists beside the config (not in the cwd) is taken from there
    assert Path(cfg.data.train) == cfg_file.parent / "prompts.jsonl"


def test_dotted_overrides_scalars_lists_null(cfg_file):
    cfg = load_config(cfg_file, ["grpo.beta=0.04", "max_steps=9", "grpo.reward_funcs=[format]",
                                 "grpo.reward_weights=[2, 0.5]", "grpo.reward_funcs=[accuracy, format]",
                                 "eval.max_new_tokens=null", "grpo.epsilon_high=0.28",
                                 "model.lora.enabled=true", "log.report_to=[tensorboard]"])
    assert cfg.grpo.beta == 0.04 and cfg.max_steps == 9
    assert cfg.grpo.reward_funcs == ["accuracy", "format"]  # the later override wins
    assert cfg.grpo.reward_weights == [2.0, 0.5] and all(isinstance(w, float) for w in cfg.grpo.reward_weights)
    assert cfg.eval.max_new_tokens is None and cfg.grpo.epsilon_high == 0.28
    assert cfg.model.lora.enabled is True and cfg.log.report_to == ["tensorboard"]
    # a union type accepts either form: a list of DPO losses, or the null-able epsilon_high back to null
    cfg = load_config(cfg_file, ["dpo.loss_type=[sigmoid, sft]", "grpo.epsilon_high=null"])
    assert cfg.dpo.loss_type == ["sigmoid", "sft"] and cfg.grpo.epsilon_high is None


def test_scientific_notation_floats(cfg_file):
    """PyYAML (YAML 1.1) reads `1e-5` as a string; float keys must still take it, in files and overrides."""
    data = yaml.safe_load(cfg_file.read_text())
    cfg_file.write_text(cfg_file.read_text().replace("lr: 1.0e-05", "lr: 3e-4"))
    assert "3e-4" in cfg_file.read_text() and data["optim"]["lr"] == 1e-5
    assert load_config(cfg_file).optim.lr == 3e-4
    cfg = load_config(cfg_file, ["grpo.beta=4E-2", "grpo.reward_weights=[1e-1, 2]"])
    assert cfg.grpo.beta == 0.04 and cfg.grpo.reward_weights == [0.1, 2.0]
    assert "expected a number" in _error(cfg_file, ["optim.lr=1e-5x"])
    assert "expected an integer" in _error(cfg_file, ["max_steps=1e3"])  # ints stay strict


def test_override_without_config_file(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"input": "x"}\n')
    cfg = load_config(None, [f"data.train={tmp_path / 'p.jsonl'}", "algorithm=dpo"])
    assert cfg.algorithm == "dpo" and cfg.data.train == str(tmp_path / "p.jsonl")


@pytest.mark.parametrize("override, named, suggested", [
    ("max_step=3", "'max_steps'", "max_step"),  # top level
    ("grpo.betta=0.1", "'grpo.beta'", "grpo.betta"),  # nested
    ("model.lora.rank=8", None, "model.lora.rank"),  # two levels deep, nothing close: lists the keys
    ("optimizer.lr=1e-4", "'optim'", "optimizer"),  # an unknown section
])
def test_unknown_key_names_it_and_nearest(cfg_file, override, named, suggested):
    msg = _error(cfg_file, [override])
    assert f"'{suggested}'" in msg
    if named:
        assert f"did you mean {named}" in msg
    else:
        assert "valid keys:" in msg and "alpha" in msg


def test_unknown_key_in_yaml(tmp_path, cfg_file):
    data = yaml.safe_load(cfg_file.read_text())
    data["grpo"]["num_generation"] = 4
    cfg_file.write_text(yaml.safe_dump(data))
    assert "did you mean 'grpo.num_generations'" in _error(cfg_file)


@pytest.mark.parametrize("override, key, expect", [
    ("max_steps=abc", "max_steps", "integer"),
    ("max_steps=2.5", "max_steps", "integer"),
    ("max_steps=true", "max_steps", "integer"),  # a bool is not an int here
    ("grpo.beta=[1]", "grpo.beta", "number"),
    ("grpo.reward_funcs=accuracy", "grpo.reward_funcs", "list"),
    ("grpo.reward_weights=[1, x]", "grpo.reward_weights[1]", "number"),
    ("model.lora.enabled=yes please", "model.lora.enabled", "true or false"),
    ("grpo=3", "grpo", "mapping"),
    ("eval.max_new_tokens=abc", "eval.max_new_tokens", "integer"),
])
def test_wrong_types_name_the_key(cfg_file, override, key, expect):
    msg = _error(cfg_file, [override])
    assert msg.startswith(f"{key}:") and expect in msg


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_invalid_choices(cfg_file, key):
    msg = _error(cfg_file, [f"{key}=nonsense"])
    assert msg.startswith(f"{key}:") and "nonsense" in msg
    assert all(choice in msg for choice in CHOICES[key])


@pytest.mark.parametrize("override, key", [
    ("max_steps=0", "max_steps"),
    ("grpo.num_generations=1", "grpo.num_generations"),
    ("grpo.micro_batch_size=0", "grpo.micro_batch_size"),
    ("grpo.reward_weights=[1, 2, 3]", "grpo.reward_weights"),
    ("data.train=", "data.train"),
    ("save_steps=-1", "save_steps"),
    # each of these crashed inside training (ZeroDivisionError, NaN sampling, ValueError) before
    ("log.logging_steps=0", "log.logging_steps"),
    ("grpo.temperature=0", "grpo.temperature"),
    ("grpo.top_p=0", "grpo.top_p"),
    ("grpo.top_p=1.5", "grpo.top_p"),
    ("grpo.beta=-0.1", "grpo.beta"),
    ("optim.lr=-1e-5", "optim.lr"),
    ("data.max_prompt_length=0", "data.max_prompt_length"),
    ("eval.batch_size=0", "eval.batch_size"),
    ("eval.max_new_tokens=0", "eval.max_new_tokens"),
    ("grpo.loss_type=cispo", "grpo.epsilon_high"),
    ("data.reward_range=[0, 1, 2]", "data.reward_range"),
    ("data.reward_range=[1, 0]", "data.reward_range"),
    ("grpo.reward_funcs=[]", "grpo.reward_funcs"),
])
def test_value_checks(cfg_file, override, key):
    assert _error(cfg_file, [override]).startswith(f"{key}:")


def test_offline_grpo_allows_one_generation(cfg_file):
    assert load_config(cfg_file, ["grpo.rollout=offline", "grpo.num_generations=1"]).grpo.num_generations == 1
    # DPO and offline GRPO need no reward function (unless an eval set is scored)
    assert load_config(cfg_file, ["algorithm=dpo", "grpo.reward_funcs=[]"]).grpo.reward_funcs == []
    assert load_config(cfg_file, ["grpo.loss_type=cispo", "grpo.epsilon_high=5"]).grpo.epsilon_high == 5.0


def test_missing_and_malformed_files(tmp_path):
    msg = _error(tmp_path / "nope.yaml")
    assert "nope.yaml" in msg and "cannot read config" in msg
    bad = tmp_path / "bad.yaml"
    bad.write_text("grpo: [unclosed\n")
    msg = _error(bad)
    assert "bad.yaml" in msg and "invalid YAML" in msg
    assert "not KEY=VALUE" in _error(None, ["max_steps"])


def test_yaml_round_trip_is_equal(cfg_file, tmp_path):
    cfg = load_config(cfg_file, ["grpo.beta=0.04", "dpo.loss_type=[sigmoid, sft]", "dpo.loss_weights=[1, 0.5]",
                                 "data.eval=null", "grpo.top_k=5", "log.report_to=[tensorboard]"])
    written = tmp_path / "out" / "config.yaml"
    written.parent.mkdir()
    written.write_text(to_yaml(cfg))
    again = load_config(written)
    assert to_dict(again) == to_dict(cfg)
    assert "config_dir" not in written.read_text()


def test_example_config_loads_from_any_cwd(monkeypatch, tmp_path):
    example = Path(__file__).resolve().parents[1] / "examples" / "grpo.yaml"
    monkeypatch.chdir(tmp_path)  # paths in the example are relative to the example's folder
    cfg = load_config(example)
    assert Path(cfg.model.name_or_path).resolve() == example.parent / "model"
    assert Path(cfg.data.train).is_file() and Path(cfg.data.eval).is_file()


def test_reward_files_resolve_beside_the_config(cfg_file, tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text("def fn(completions, **kw):\n    return [1.0] * len(completions)\n")
    monkeypatch.chdir(tmp_path.parent)  # the cwd is not the config's folder
    cfg = load_config(cfg_file, ["grpo.reward_funcs=[accuracy, my_rewards.py:fn, some.module:f]",
                                 "eval.reward_funcs=[my_rewards.py:fn]"])
    want = f"{tmp_path / 'my_rewards.py'}:fn"
    assert cfg.grpo.reward_funcs == ["accuracy", want, "some.module:f"] and cfg.eval.reward_funcs == [want]
    # the written config, loaded from elsewhere, still names the same file
    out = tmp_path / "elsewhere" / "config.yaml"
    out.parent.mkdir()
    out.write_text(to_yaml(cfg))
    again = load_config(out)
    assert to_dict(again) == to_dict(cfg)
    from preftune.rewards.functions import load_reward_function

    assert load_reward_function(again.grpo.reward_funcs[1], base_dir=again.config_dir)(completions=["a"]) == [1.0]
