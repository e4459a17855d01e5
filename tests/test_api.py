"""The Python API: preftune.train() with in-memory rewards and data, callbacks, the result, errors as
UserError, signal handlers left as found, the light package import, and the CLI over the API."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from preftune.cli.command import main
from preftune.config import load_config, to_dict
from preftune.errors import EXIT_USER, UserError
import preftune
from tests.conftest import MODEL_DIR, ROOT, TRAIN_PROMPTS, arith_traces, write_parquet
from tests.hf_folder import folder_state

TINY = {"model.name_or_path": str(MODEL_DIR), "max_steps": 2, "save_steps": 0, "log.progress_bar": False,
        "grpo.prompts_per_step": 2, "grpo.num_generations": 4, "grpo.max_completion_length": 3,
        "data.max_prompt_length": 16, "optim.lr": 1e-3, "optim.lr_scheduler": "constant"}
PROMPTS = [json.loads(line) for line in TRAIN_PROMPTS.read_text().splitlines()[:12]]


def brevity(prompts, completions, completion_ids, **columns):
    return [1.0 - len(ids) / 4 for ids in completion_ids]


def other_brevity(prompts, completions, completion_ids, **columns):
    return [0.0 for _ in completions]


def overrides(tmp_path, name="run", **extra) -> dict:
    return {**TINY, "output_dir": str(tmp_path / name), **extra}


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def handlers() -> dict:
    return {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}


@pytest.fixture
def own_handlers():
    """Handlers of the caller's own (not the defaults), so 'restored' means something."""
    def mine(signum, frame):
        pass

    old = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGINT)}
    yield handlers()
    for s, h in old.items():
        signal.signal(s, h)


def test_import_is_light_and_the_surface_is_named():
    code = ("import sys, preftune\n"
            "names = [preftune.train, preftune.load_config, preftune.Config, preftune.GRPOConfig, preftune.UserError,"
            " preftune.Preempted, preftune.TryAgain, preftune.Unavailable, preftune.TrainResult]\n"
            "import preftune.cli.command\n"
            "heavy = [m for m in ('torch', 'transformers', 'pandas', 'datasets', 'wandb', 'mlflow') if m in sys.modules]\n"
            "assert not heavy, heavy\n"
            "import preftune.run.loop\n"
            "assert callable(preftune.train) and preftune.run.loop.Run\n"  # callable even once it is the package
            "from preftune.losses import dpo_loss, grpo_loss\n"
            "assert preftune.losses.grpo_loss is grpo_loss and preftune.losses.dpo_loss is dpo_loss\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert set(preftune.__all__) >= {"train", "load_config", "Config", "UserError", "losses", "TrainResult"}
    with pytest.raises(AttributeError):
        preftune.not_a_name


def test_config_as_path_dict_or_dataclass(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(f"output_dir: {tmp_path / 'run'}\ndata: {{train: {TRAIN_PROMPTS}}}\ngrpo: {{beta: 0.1}}\n")
    from_path = load_config(path, ["grpo.beta=0.04"])
    from_dict = load_config({"output_dir": str(tmp_path / "run"), "data": {"train": str(TRAIN_PROMPTS)},
                             "grpo": {"beta": 0.04}})
    from_cfg = load_config(from_dict, ["max_steps=7"])
    assert to_dict(from_path) == to_dict(from_dict)
    assert to_dict(from_cfg) == {**to_dict(from_dict), "max_steps": 7} and from_dict.max_steps == 100
    with pytest.raises(UserError, match="unknown config key 'grpo.bta'"):
        preftune.train({"grpo": {"bta": 1}})
    with pytest.raises(UserError, match="grpo.beta"):
        preftune.train(path, overrides={"grpo.beta": "much"})


def test_grpo_with_a_python_reward_a_dataset_and_callbacks(tmp_path, own_handlers):
    import datasets

    seen = []
    result = preftune.train({}, overrides=overrides(tmp_path), reward_funcs=[brevity, "accuracy"],
                            train_data=datasets.Dataset.from_list(PROMPTS), eval_data=PROMPTS[:4],
                            callbacks=[lambda step, m: seen.append((step, m))])
    out = tmp_path / "run"
    assert handlers() == own_handlers  # the run's SIGTERM/SIGINT handlers are gone again
    assert result.model_path == out / "final" and (out / "final" / "config.json").is_file()
    assert result.step == 2 and not result.stopped_early
    recs = records(out)
    assert seen == [(r["step"], {k: v for k, v in r.items() if k != "step"}) for r in recs]
    assert result.metrics == recs[-2] and result.metrics["step"] == 2 and "rewards/brevity/mean" in result.metrics
    assert [r["step"] for r in result.eval] == [0, 2] and all("eval/rewards/brevity/mean" in r for r in result.eval)
    saved = load_config(out / "config.yaml")
    assert saved.grpo.reward_funcs == ["callable:tests.test_api.brevity", "accuracy"]
    assert saved.data.train.startswith("in-memory:train_data@") and saved.data.eval.startswith("in-memory:eval_data@")
    assert json.loads((out / "data_report.json").read_text()) == {"prompts": 12}


def final_weights(out: Path) -> dict:
    return folder_state(out / "final")


def test_callback_stop_then_resume_needs_the_same_functions_and_data(tmp_path, capsys):
    def stop_at_1(step, m):
        return step == 1 and "loss" in m

    kw = dict(reward_funcs=[brevity], train_data=PROMPTS)
    first = preftune.train({}, overrides=overrides(tmp_path, max_steps=3), callbacks=[stop_at_1], **kw)
    out = tmp_path / "run"
    assert first.stopped_early and first.step == 1 and first.model_path.is_dir()
    assert (out / "checkpoints" / "step-1").is_dir()  # saved, as a preemption saves
    # a resume not handed the same functions or data is refused before anything changes
    before = sorted(p.name for p in out.iterdir())
    changed = r"grpo.reward_funcs: \['callable:tests.test_api.brevity'\] -> \['callable:tests.test_api.other_brevity'\]"
    with pytest.raises(UserError, match=changed):
        preftune.train({}, overrides=overrides(tmp_path, max_steps=3), reward_funcs=[other_brevity],
                       train_data=PROMPTS)
    with pytest.raises(UserError, match="callable:tests.test_api.brevity"):
        preftune.train({}, overrides=overrides(tmp_path, max_steps=3), train_data=PROMPTS)
    with pytest.raises(UserError, match="data.train"):
        preftune.train({}, overrides=overrides(tmp_path, max_steps=3), reward_funcs=[brevity], train_data=PROMPTS[1:])
    with pytest.raises(UserError, match="grpo.reward_funcs: 'callable:tests.test_api.brevity' is a Python function"):
        preftune.train(out / "config.yaml", train_data=PROMPTS)
    code = main(["train", str(out / "config.yaml")])  # the command line cannot hand the function over
    err = capsys.readouterr().err
    assert code == EXIT_USER and "handed to preftune.train(" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in out.iterdir()) == before
    # the same functions and data: it continues from step 1, as an uninterrupted run would
    resumed = preftune.train({}, overrides=overrides(tmp_path, max_steps=3), **kw)
    assert resumed.step == 3 and not resumed.stopped_early
    assert [r["step"] for r in records(out) if "loss" in r] == [1, 2, 3]
    whole = preftune.train({}, overrides=overrides(tmp_path, "whole", max_steps=3), **kw)
    a, b = final_weights(out), final_weights(whole.output_dir)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_dpo_from_a_dataframe_of_traces(tmp_path):
    import pandas as pd

    rows = arith_traces(4)
    rows[1]["output"] = ""  # invalid: dropped under data.invalid=drop, counted like in a file
    rows.append(dict(rows[0]))  # an exact duplicate
    df = pd.DataFrame(rows)
    file = write_parquet(tmp_path / "traces.parquet", rows)
    opts = {"algorithm": "dpo", "data.invalid": "drop", "dpo.batch_size": 2, "dpo.micro_batch_size": 2,
            "dpo.max_length": 16, "grpo.reward_funcs": []}
    from_df = preftune.train({}, overrides=overrides(tmp_path, "df", **opts), train_data=df)
    from_file = preftune.train({}, overrides=overrides(tmp_path, "file", **opts, **{"data.train": str(file)}))
    assert from_df.step == 2
    report = json.loads((from_df.output_dir / "data_report.json").read_text())
    assert report == json.loads((from_file.output_dir / "data_report.json").read_text())
    assert report["traces"]["dropped"] == {"duplicate": 1, "empty_response": 1}
    assert [r["loss"] for r in records(from_df.output_dir)] == [r["loss"] for r in records(from_file.output_dir)]


def test_in_memory_tables_are_validated_like_files(tmp_path):
    import pandas as pd

    from preftune.data import in_memory as memory
    from preftune.data.traces import TraceOptions, load_traces

    rows = arith_traces(3)
    rows[2]["output"] = "  "
    file = write_parquet(tmp_path / "t.parquet", rows)
    with pytest.raises(UserError) as from_file:
        load_traces(str(file))
    spec = memory.register(pd.DataFrame(rows), "train_data")
    try:
        with pytest.raises(UserError) as from_memory:
            load_traces(spec)
        assert str(from_memory.value) == "train_data row 2 column output: response is empty"
        assert str(from_file.value) == f"{file} row 2 column output: response is empty"
        kept, report = load_traces(spec, TraceOptions(invalid="drop"))
        kept_file, report_file = load_traces(str(file), TraceOptions(invalid="drop"))
        assert report.dropped == report_file.dropped and report.kept == report_file.kept == len(rows) - 1
        assert [(t.prompt, t.response, t.reward, t.row, t.extra) for t in kept] == \
            [(t.prompt, t.response, t.reward, t.row, t.extra) for t in kept_file]
        # the same rows as a list give the same name (content hash); other rows another one
        assert memory.register(rows, "train_data") == spec and memory.register(rows[1:], "train_data") != spec
    finally:
        memory.TABLES.clear()
    with pytest.raises(UserError, match="missing column 'final_reward'"):
        preftune.train({}, overrides=overrides(tmp_path, algorithm="dpo"), train_data=[{"input": "1+1=", "output": "2"}])
    with pytest.raises(UserError, match="train_data: row 1: expected a dict, got str"):
        preftune.train({}, overrides=overrides(tmp_path), train_data=[{"input": "1+1="}, "2+2="])
    with pytest.raises(UserError, match="train_data: expected a datasets.Dataset, a pandas DataFrame or a list"):
        preftune.train({}, overrides=overrides(tmp_path), train_data=42)
    with pytest.raises(UserError, match="eval_data: has no rows"):
        preftune.train({}, overrides=overrides(tmp_path), train_data=PROMPTS, eval_data=[])
    assert not memory.TABLES


def test_errors_and_exceptions_leave_handlers_as_found(tmp_path, own_handlers):
    def boom(prompts, completions, **kw):
        raise ValueError("no")

    with pytest.raises(UserError, match="reward 'boom': raised ValueError: no"):
        preftune.train({}, overrides=overrides(tmp_path), reward_funcs=[boom], train_data=PROMPTS)
    assert handlers() == own_handlers

    def crash(step, m):
        if step == 1:
            raise RuntimeError("callback bug")

    with pytest.raises(RuntimeError, match="callback bug"):  # the caller's exception, not a SystemExit
        preftune.train({}, overrides=overrides(tmp_path, "b"), reward_funcs=[brevity], train_data=PROMPTS,
                       callbacks=[crash])
    assert handlers() == own_handlers

    def notice(step, m):  # a spot notice (or a notebook's interrupt) arriving during step 1
        if step == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    with pytest.raises(preftune.Preempted, match="preempted at step 1; checkpoint step-1 saved"):
        preftune.train({}, overrides=overrides(tmp_path, "c"), reward_funcs=[brevity], train_data=PROMPTS,
                       callbacks=[notice])
    assert handlers() == own_handlers and (tmp_path / "c" / "checkpoints" / "step-1").is_dir()
    from preftune.data import in_memory as memory
    from preftune.rewards.functions import CALLABLES

    assert not memory.TABLES and not CALLABLES  # nothing of the call stays registered
