"""OutputGuard: a run that stops before its first step leaves output_dir as it found it."""
from __future__ import annotations

import pytest

from preftune.run.outdir import OutputGuard


def tree(folder):
    return {p.relative_to(folder).as_posix(): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def test_rollback_restores_an_existing_folder(tmp_path):
    out = tmp_path / "out"
    (out / "tb").mkdir(parents=True)
    (out / "config.yaml").write_text("old\n")
    (out / "metrics.jsonl").write_text('{"step": 1}\n')
    (out / "tb" / "events.1").write_text("e1")
    before = tree(out)
    with pytest.raises(ValueError), OutputGuard(out):
        (out / "config.yaml").write_text("new\n")  # replaced
        (out / "metrics.jsonl").unlink()  # removed
        (out / "data_report.json").write_text("{}")  # created
        (out / "tb" / "events.2").write_text("e2")  # created inside an old folder
        (out / "extra" / "deep").mkdir(parents=True)
        raise ValueError("reward function raised")
    assert tree(out) == before


def test_new_folder_is_removed_and_checkpoints_are_never_touched(tmp_path):
    out = tmp_path / "a" / "out"
    with pytest.raises(KeyError), OutputGuard(out):
        (out / "x").mkdir(parents=True)
        raise KeyError("x")
    assert not out.exists()
    out.mkdir()
    with pytest.raises(KeyError), OutputGuard(out):
        (out / "checkpoints" / "damaged-step-2").mkdir(parents=True)  # resume.py's set-aside: kept
        raise KeyError("x")
    assert (out / "checkpoints" / "damaged-step-2").is_dir()


def test_commit_keeps_what_the_run_wrote(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError), OutputGuard(out) as guard:
        out.mkdir()
        (out / "metrics.jsonl").write_text("{}\n")
        guard.commit()  # the first optimizer step is done
        raise RuntimeError("crash at step 7")
    assert (out / "metrics.jsonl").read_text() == "{}\n"
    with OutputGuard(out):  # no error: nothing undone
        (out / "final").mkdir()
    assert (out / "final").is_dir()


def test_a_final_published_by_another_process_is_never_rolled_back(tmp_path):
    """Issue 25: the folder as it was, but final/ (which a run before its first step never writes) stays;
    with the lock lost to another process nothing is undone."""
    out = tmp_path / "out"
    (out / "checkpoints").mkdir(parents=True)
    with pytest.raises(KeyError), OutputGuard(out):
        (out / "final").mkdir()
        (out / "final" / "model.safetensors").write_text("another process's model")
        (out / "config.yaml").write_text("mine")
        raise KeyError("x")
    assert (out / "final" / "model.safetensors").is_file() and not (out / "config.yaml").exists()
    with pytest.raises(KeyError), OutputGuard(out, may_roll_back=lambda: False):
        (out / "metrics.jsonl").write_text("theirs")
        raise KeyError("x")
    assert (out / "metrics.jsonl").is_file()
