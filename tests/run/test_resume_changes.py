"""A changed config is never resumed silently (issue 35): every key is compared with the config the
checkpoint (or final/) was saved under. A change that shapes training (optim.lr, dpo.beta) stops with
exit 78 / UserError, one line per key and the ways forward, also for a finished run; a free change
(a larger max_steps) is accepted and logged; `resume_with_changes: true` goes on and records it."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

import preftune
from preftune.cli.command import main
from preftune.config import Config, load_config
from preftune.config.fields import FIXED, FREE, ON_RESUME, TRAJECTORY, keys, knob, on_resume, section
from preftune.errors import EXIT_OK, EXIT_USER, UserError
from preftune.run import loop
from preftune.run.resume import HISTORY
from tests.run.test_resume import (  # noqa: F401 - fixtures used by name
    data_dir, one_thread, overrides, reference, saved_steps, write_config,
)

LR_BEFORE, LR_AFTER = 3.0e-4, 1.0e-4  # overrides() trains at 3e-4


def test_every_key_has_exactly_one_answer():
    kinds = on_resume(Config)
    assert list(kinds) == [k for k, _, _ in keys(Config)]  # every key, each once
    assert set(kinds.values()) <= set(ON_RESUME)
    # what a resume could never honour, as before (the model, data and order, batch shape, seed)
    for key in ("algorithm", "seed", "model.name_or_path", "model.dtype", "model.lora.r", "data.train", "data.shuffle",
                "grpo.rollout", "grpo.prompts_per_step", "grpo.num_generations", "dpo.batch_size", "eval.split"):
        assert kinds[key] == FIXED, key
    for key in ("optim.lr", "optim.lr_scheduler", "dpo.beta", "grpo.beta", "grpo.loss_type", "grpo.temperature",
                "grpo.reward_funcs", "kto.beta", "grpo.micro_batch_size"):
        assert kinds[key] == TRAJECTORY, key
    for key in ("max_steps", "save_steps", "output_dir", "log.report_to", "log.progress_bar", "eval.eval_steps",
                "data.eval", "checkpoint_uri_timeout_seconds", "resume_with_changes", "deploy.nodes"):
        assert kinds[key] == FREE, key


@dataclasses.dataclass
class _Inner:
    a: int = knob(1, "a")
    b: int = knob(1, "b", resume=FREE)


@dataclasses.dataclass
class _Outer:
    x: int = knob(1, "x")
    inner: _Inner = section(_Inner)
    logs: _Inner = section(_Inner, resume=FREE)


def test_a_key_without_a_declaration_is_trajectory_and_a_section_decides_for_its_keys():
    """The safe default: a key nobody classified is refused on a change, not resumed silently."""
    assert on_resume(_Outer) == {"x": TRAJECTORY, "inner.a": TRAJECTORY, "inner.b": FREE, "logs.a": FREE,
                                 "logs.b": FREE}
    with pytest.raises(ValueError):
        knob(1, "y", resume="maybe")


def _unfinished(reference, data_dir, tmp_path, kind: str = "online") -> Path:
    """A copy of a 5-step run stopped at its step-4 checkpoint (no step 5, no final/)."""
    out = tmp_path / "run"
    shutil.copytree(reference(kind), out)
    shutil.rmtree(out / "final")
    shutil.rmtree(out / "checkpoints" / "step-5")
    return out


def _tree(out: Path) -> dict:
    return {str(p.relative_to(out)): p.stat().st_mtime_ns for p in sorted(out.rglob("*"))}


def _assert_refusal(err: str, *lines: str, opt_in: bool = True) -> None:
    err_lines = err.strip().splitlines()
    assert err_lines[0].startswith("preftune: error: refusing to resume"), err
    for line in lines:
        assert f"  {line}" in err_lines, (line, err)
    ways = err_lines[-1]
    assert ways.startswith("to go on: a new output_dir") and "overwrite_output_dir=true" in ways
    assert ("resume_with_changes=true" in ways) == opt_in


def test_cli_lr_change_on_an_unfinished_run_is_refused(reference, data_dir, tmp_path, capsys):
    out = _unfinished(reference, data_dir, tmp_path)
    before = _tree(out)
    cfg = write_config(tmp_path / "run.yaml")
    assert main(["train", str(cfg), *overrides("online", out, data_dir, **{"optim.lr": LR_AFTER})]) == EXIT_USER
    _assert_refusal(capsys.readouterr().err, f"optim.lr: {LR_BEFORE!r} -> {LR_AFTER!r}")
    assert _tree(out) == before  # refused before anything was touched


def test_cli_a_finished_run_with_a_changed_lr_is_not_already_complete(reference, data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(reference("online"), out)
    before = _tree(out)
    cfg = write_config(tmp_path / "run.yaml")
    assert main(["train", str(cfg), *overrides("online", out, data_dir, **{"optim.lr": LR_AFTER})]) == EXIT_USER
    captured = capsys.readouterr()
    assert "already complete" not in captured.out
    _assert_refusal(captured.err, f"optim.lr: {LR_BEFORE!r} -> {LR_AFTER!r}")
    assert "finished run" in captured.err.splitlines()[0]
    assert _tree(out) == before
    # the same config again: complete, nothing to do
    assert main(["train", str(cfg), *overrides("online", out, data_dir)]) == EXIT_OK
    assert "already complete" in capsys.readouterr().out


def test_cli_dpo_beta_change_is_refused_and_a_fixed_key_cannot_be_opted_in(reference, data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(reference("dpo"), out)
    cfg = write_config(tmp_path / "run.yaml")
    assert main(["train", str(cfg), *overrides("dpo", out, data_dir, **{"dpo.beta": 0.2})]) == EXIT_USER
    _assert_refusal(capsys.readouterr().err, "dpo.beta: 0.1 -> 0.2")
    ovr = overrides("dpo", out, data_dir, **{"dpo.beta": 0.2, "dpo.batch_size": 8, "resume_with_changes": "true"})
    assert main(["train", str(cfg), *ovr]) == EXIT_USER
    err = capsys.readouterr().err  # only what the opt-in does not cover is listed
    _assert_refusal(err, "dpo.batch_size: 4 -> 8 (fixed: cannot change on a resume)", opt_in=False)
    assert "dpo.beta" not in err


def test_cli_a_larger_max_steps_is_accepted_and_logged(reference, data_dir, tmp_path, capsys, caplog):
    out = tmp_path / "run"
    shutil.copytree(reference("online"), out)
    cfg = write_config(tmp_path / "run.yaml")
    with caplog.at_level("INFO", logger="preftune"):
        assert main(["train", str(cfg), *overrides("online", out, data_dir, max_steps=6)]) == EXIT_OK
    assert "with a changed max_steps: 5 -> 6" in caplog.text
    assert saved_steps(out) == [6, 5, 4, 2]
    (record,) = [json.loads(line) for line in (out / HISTORY).read_text().splitlines()]
    assert record["step"] == 5 and record["changes"]["max_steps"] == {"from": 5, "to": 6, "kind": FREE}
    assert set(record["changes"]) == {"max_steps", "output_dir"}  # the copy lives in another folder: free too


def test_cli_opt_in_continues_with_the_change_and_records_it(reference, data_dir, tmp_path, caplog):
    out = _unfinished(reference, data_dir, tmp_path)
    cfg = write_config(tmp_path / "run.yaml")
    ovr = overrides("online", out, data_dir, **{"optim.lr": LR_AFTER, "resume_with_changes": "true"})
    with caplog.at_level("INFO", logger="preftune"):
        assert main(["train", str(cfg), *ovr]) == EXIT_OK
    assert f"with a changed optim.lr: {LR_BEFORE!r} -> {LR_AFTER!r} (resume_with_changes)" in caplog.text
    (record,) = [json.loads(line) for line in (out / HISTORY).read_text().splitlines()]
    assert record["step"] == 4 and record["resume_with_changes"] is True
    assert record["changes"]["optim.lr"] == {"from": LR_BEFORE, "to": LR_AFTER, "kind": TRAJECTORY}
    assert record["changes"]["resume_with_changes"]["kind"] == FREE
    assert load_config(str(out / "final" / "preftune.yaml")).optim.lr == LR_AFTER
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    lrs = {r["step"]: r["learning_rate"] for r in steps if "learning_rate" in r}
    assert lrs[5] == pytest.approx(LR_AFTER * 1 / 5) and lrs[4] == pytest.approx(LR_BEFORE * 2 / 5)  # linear decay
    # the changed config is now the run's: the same command again is complete
    assert loop.train(load_config(None, ovr)) == out / "final"


def test_python_raises_the_same_user_error(reference, data_dir, tmp_path):
    out = _unfinished(reference, data_dir, tmp_path)
    with pytest.raises(UserError, match=r"optim.lr: 0.0003 -> 0.0001") as info:
        preftune.train({}, overrides=overrides("online", out, data_dir, **{"optim.lr": LR_AFTER}))
    assert "resume_with_changes=true" in str(info.value)
    dpo = tmp_path / "dpo"
    shutil.copytree(reference("dpo"), dpo)
    with pytest.raises(UserError, match=r"refusing to resume the finished run .*\n  dpo.beta: 0.1 -> 0.2\n"):
        preftune.train({}, overrides=overrides("dpo", dpo, data_dir, **{"dpo.beta": 0.2}))
    result = preftune.train({}, overrides=overrides("dpo", dpo, data_dir, **{"dpo.beta": 0.2}, max_steps=6,
                                                                  resume_with_changes="true"))
    assert result.step == 6
    (record,) = [json.loads(line) for line in (dpo / HISTORY).read_text().splitlines()]
    assert record["changes"]["dpo.beta"] == {"from": 0.1, "to": 0.2, "kind": TRAJECTORY}


def test_python_accepts_a_larger_max_steps_and_records_it(reference, data_dir, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(reference("online"), out)
    result = preftune.train({}, overrides=overrides("online", out, data_dir, max_steps=6))
    assert result.step == 6 and saved_steps(out)[0] == 6
    (record,) = [json.loads(line) for line in (out / HISTORY).read_text().splitlines()]
    assert record["changes"]["max_steps"] == {"from": 5, "to": 6, "kind": FREE}
    assert {c["kind"] for c in record["changes"].values()} == {FREE}
