"""The `preftune` command: exit codes, one-line errors without tracebacks, train output, data subcommands."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from preftune.cli.command import main
from preftune.errors import EXIT_OK, EXIT_USER
from tests.conftest import MODEL_DIR, ROOT, TRAIN_PROMPTS, arith_traces, write_jsonl, write_parquet

TINY = ["max_steps=1", "save_steps=0", "log.progress_bar=false", "grpo.prompts_per_step=2",
        "grpo.num_generations=2", "grpo.max_completion_length=3", "data.max_prompt_length=16"]


@pytest.fixture
def config(tmp_path) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(f"algorithm: grpo\noutput_dir: {tmp_path / 'out'}\nmodel:\n  name_or_path: {MODEL_DIR}\n"
                    f"data:\n  train: {TRAIN_PROMPTS}\n")
    return path


def run_main(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def user_error(capsys, *argv) -> str:
    """Exit 78 with exactly one line on stderr, no traceback; returns that line."""
    code, _, err = run_main(capsys, *argv)
    assert code == EXIT_USER, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("preftune: error: "), err
    return lines[0]


def test_unknown_config_key(capsys, config):
    line = user_error(capsys, "train", config, "grpo.betta=0.1")
    assert "'grpo.betta'" in line and "did you mean 'grpo.beta'" in line


def test_missing_config_file(capsys, tmp_path):
    line = user_error(capsys, "train", tmp_path / "missing.yaml")
    assert "missing.yaml" in line


@pytest.mark.parametrize("command", ["train", "eval", "render", "launch"])
def test_a_missing_config_is_named_and_overrides_are_optional(command, capsys):
    with pytest.raises(SystemExit) as e:  # argparse's usage errors, mapped to 78
        main([command])
    err = capsys.readouterr().err
    assert e.value.code == EXIT_USER and "Traceback" not in err
    line = err.strip().splitlines()[-1]
    assert "required: config" in line and "overrides" not in line


def test_missing_data_file(capsys, config, tmp_path):
    line = user_error(capsys, "train", config, f"data.train={tmp_path / 'nope.jsonl'}", *TINY)
    assert "nope.jsonl" in line and "no such file" in line


def test_nan_reward_names_file_row_column(capsys, config, tmp_path):
    rows = arith_traces(2)
    rows[3]["final_reward"] = math.nan
    path = write_parquet(tmp_path / "bad.parquet", rows)
    line = user_error(capsys, "data", "inspect", path)
    assert "bad.parquet row 3 column final_reward" in line and "NaN" in line
    line = user_error(capsys, "train", config, "algorithm=dpo", f"data.train={path}", *TINY)
    assert "bad.parquet row 3 column final_reward" in line


def test_unknown_reward_function(capsys, config):
    line = user_error(capsys, "train", config, "grpo.reward_funcs=[acuracy]", *TINY)
    assert "reward 'acuracy'" in line and "did you mean 'accuracy'" in line


def test_reward_function_that_raises_in_process(capsys, config, tmp_path):
    (tmp_path / "bad_reward.py").write_text("def explode(completions, **kw):\n    raise KeyError('answer')\n")
    line = user_error(capsys, "train", config, "grpo.reward_funcs=[bad_reward.py:explode]", *TINY)
    assert "reward 'explode'" in line and "KeyError" in line  # resolved beside the config file


def test_reward_function_that_raises_subprocess(config, tmp_path):
    """The real entry point: exit 78, the error is the last stderr line, and no traceback."""
    (tmp_path / "bad_reward.py").write_text("def explode(completions, **kw):\n    return 1 / 0\n")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-m", "preftune.cli", "train", str(config),
                           "grpo.reward_funcs=[bad_reward.py:explode]", *TINY],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == EXIT_USER, proc.stderr
    assert "Traceback" not in proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith("preftune: error:")]
    assert len(errors) == 1 and errors[0] == proc.stderr.strip().splitlines()[-1]
    assert "reward 'explode'" in errors[0] and "ZeroDivisionError" in errors[0]


def test_tiny_run_prints_model_and_metrics(capsys, config, tmp_path):
    code, out, _ = run_main(capsys, "train", config, *TINY)
    assert code == EXIT_OK
    final, metrics = tmp_path / "out" / "final", tmp_path / "out" / "metrics.jsonl"
    assert f"model: {final}" in out and f"metrics: {metrics}" in out
    assert (final / "config.json").is_file() and metrics.is_file()


# ---------------------------------------------------------------- data subcommands


@pytest.fixture
def traces(tmp_path) -> Path:
    return write_parquet(tmp_path / "traces.parquet", arith_traces(3))


def test_data_inspect_json(capsys, traces):
    code, out, _ = run_main(capsys, "data", "inspect", traces, "--json")
    assert code == EXIT_OK
    report = json.loads(out)
    assert report["rows"] == 12 and report["prompts"] == 3
    assert report["responses_per_prompt"] == {"4": 3}
    assert report["dpo"]["pairs_made"] == 3 and report["grpo"]["groups_made"] == 3
    code, out, _ = run_main(capsys, "data", "inspect", traces, "--strategy", "all_pairs", "--json")
    assert json.loads(out)["dpo"]["pairs_made"] == 9  # 1 chosen x 3 rejected per prompt


def test_data_commands_take_dotted_data_overrides_as_train_does(capsys, traces):
    code, out, _ = run_main(capsys, "data", "inspect", traces, "--json", "data.pair_strategy=all_pairs",
                            "data.invalid=drop")
    assert code == EXIT_OK and json.loads(out)["dpo"]["pairs_made"] == 9
    code, _, err = run_main(capsys, "data", "inspect", traces, "data.pair_strategy=nope")
    assert code == 78 and "data.pair_strategy" in err and "nope" in err
    with pytest.raises(SystemExit) as e:  # a usage error, as argparse's own (one line, 78)
        run_main(capsys, "data", "inspect", traces, "data.train=x.jsonl")
    assert e.value.code == 78 and "data.train is not an option of `preftune data`" in capsys.readouterr().err


def test_data_inspect_text(capsys, traces):
    code, out, _ = run_main(capsys, "data", "inspect", traces)
    assert code == EXIT_OK and "distinct prompts: 3" in out


def test_data_pairs_writes_file(capsys, traces, tmp_path):
    from preftune.data.pairs import read_pairs

    dest = tmp_path / "pairs.parquet"
    code, out, _ = run_main(capsys, "data", "pairs", traces, "-o", dest, "--strategy", "all_pairs")
    assert code == EXIT_OK and "wrote 9 pairs" in out
    pairs = read_pairs(str(dest))
    assert len(pairs) == 9 and all(p.chosen_reward >= 0.7 > 0.5 > p.rejected_reward for p in pairs)


def test_data_pairs_failure_writes_nothing(capsys, traces, tmp_path):
    dest = tmp_path / "pairs.parquet"
    line = user_error(capsys, "data", "pairs", traces, "-o", dest, "--chosen-min", "1.5")
    assert "no DPO pairs" in line and not dest.exists()
    jsonl = write_jsonl(tmp_path / "t.jsonl", [{"input": "p", "output": "r", "final_reward": "high"}])
    line = user_error(capsys, "data", "pairs", jsonl, "-o", dest)
    assert "t.jsonl row 0 column final_reward" in line and not dest.exists()


def test_the_console_script_is_the_process_entry():
    """`preftune` runs `script` (the signal handler at its first line, exit without the interpreter's
    teardown, whose C++ thread destructors could abort a finished rank), not plain `main`."""
    import tomllib

    from tests.conftest import ROOT

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"preftune": "preftune.cli.command:script"}
