"""Preemption with real signals to a real `preftune train` process: SIGTERM at several steps and
resume to the end (bitwise equal to the uninterrupted run), SIGKILL in the middle of a save, a second
signal during the save; plus the in-process handler semantics (setup, SIGINT, grace period)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preftune.cli.command import main
from preftune.errors import EXIT_OK, EXIT_PREEMPTED, Preempted
from preftune.run import checkpoint_folders as ckpt, loop
from preftune.run.preemption import Preemption, StepAbandoned
from tests.run.test_resume import (  # noqa: F401 - fixtures used by name
    assert_same_run, data_dir, one_thread, overrides, records, saved_steps, sigterm_during, write_config,
)

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 8

# Runs `preftune train` after an optional test hook: with PREFTUNE_TEST_SAVE_MARKER set, each save of
# a step in PREFTUNE_TEST_SAVE_STEPS (all when empty) writes the marker file once its manifest is
# written, then sleeps PREFTUNE_TEST_SAVE_PAUSE seconds before the fsync and the rename.
DRIVER = """
import os, sys, time
from pathlib import Path
from preftune.run import checkpoint_folders as ck

marker = os.environ.get("PREFTUNE_TEST_SAVE_MARKER")
if marker:
    only = {int(s) for s in os.environ.get("PREFTUNE_TEST_SAVE_STEPS", "").split(",") if s}
    pause = float(os.environ.get("PREFTUNE_TEST_SAVE_PAUSE", "60"))
    write = ck.write_manifest

    def slow(folder, step):
        write(folder, step)
        if folder.name.startswith(ck.TMP_PREFIX + "step-") and (not only or step in only):
            Path(marker).write_text(str(step))
            time.sleep(pause)

    ck.write_manifest = slow
from preftune.cli.command import main
sys.exit(main(sys.argv[1:]))
"""


class Proc:
    """A `preftune train` subprocess with its log in a file (no pipe to fill up)."""

    def __init__(self, tmp: Path, out: Path, data: Path, name: str, hook: dict | None = None, **extra):
        driver = tmp / "driver.py"
        driver.write_text(DRIVER)
        cfg = write_config(tmp / "run.yaml")
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(hook or {}))
        for k in [k for k in env if k.startswith("PREFTUNE_TEST_") and k not in (hook or {})]:
            del env[k]
        self.log = tmp / f"{name}.log"
        ovr = overrides("online", out, data, max_steps=MAX_STEPS, **extra)
        cmd = [sys.executable, str(driver), "train", str(cfg), *ovr] if hook else \
            [sys.executable, "-m", "preftune.cli", "train", str(cfg), *ovr]
        with open(self.log, "w") as f:
            self.p = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=tmp)

    def text(self) -> str:
        return self.log.read_text()

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.p.wait(timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            raise AssertionError(f"timed out; log:\n{self.text()[-3000:]}") from None

    def until(self, cond, what: str, timeout: float = 120) -> None:
        """Poll until cond() holds; fail if the process ends first."""
        end = time.monotonic() + timeout
        while not cond():
            if self.p.poll() is not None:
                raise AssertionError(f"exited {self.p.returncode} before {what}; log:\n{self.text()[-3000:]}")
            if time.monotonic() > end:
                self.p.kill()
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.02)

    def signal(self, sig) -> None:
        self.p.send_signal(sig)


def n_records(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


@pytest.fixture(scope="module")
def cli_reference(tmp_path_factory, data_dir) -> Path:
    tmp = tmp_path_factory.mktemp("cli-ref")
    proc = Proc(tmp, tmp / "run", data_dir, "ref")
    assert proc.wait() == EXIT_OK, proc.text()[-3000:]
    return tmp / "run"


def test_sigterm_at_several_steps_then_resume_equals_uninterrupted(cli_reference, data_dir, tmp_path):
    out, stops = tmp_path / "run", []
    for i, after in enumerate((2, 5)):  # SIGTERM once this many steps are logged
        proc = Proc(tmp_path, out, data_dir, f"part{i}", save_steps=3)
        proc.until(lambda: n_records(out) >= after, f"{after} records")
        proc.signal(signal.SIGTERM)
        assert proc.wait() == EXIT_PREEMPTED, proc.text()[-3000:]
        assert "checkpoint" in proc.text() and "resume to continue" in proc.text()
        stops.append(saved_steps(out)[0])
        assert [r["step"] for r in records(out)] == list(range(1, stops[-1] + 1))
        assert ckpt.verify(out / "checkpoints" / f"step-{stops[-1]}") is None
    assert stops[0] >= 2 and stops[1] >= 5 and stops[1] < MAX_STEPS, stops
    last = Proc(tmp_path, out, data_dir, "last", save_steps=3)
    assert last.wait() == EXIT_OK, last.text()[-3000:]
    assert f"step-{stops[1]} (step {stops[1]})" in last.text()  # "resumed from .../step-N (step N)"
    assert_same_run(cli_reference, out)


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGUSR1])
def test_sighup_and_sigusr1_save_and_exit_75_like_sigterm(data_dir, tmp_path, sig):
    """Issue 25: SIGHUP exited 129 and SIGUSR1 138, nothing saved (a container runtime may send either)."""
    out = tmp_path / "run"
    proc = Proc(tmp_path, out, data_dir, "run", save_steps=0)
    proc.until(lambda: n_records(out) >= 2, "2 records")
    proc.signal(sig)
    assert proc.wait() == EXIT_PREEMPTED, proc.text()[-3000:]
    assert f"received {signal.Signals(sig).name}" in proc.text() and saved_steps(out)


def test_sigkill_during_a_save_leaves_only_complete_checkpoints(cli_reference, data_dir, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "saving"
    hook = {"PREFTUNE_TEST_SAVE_MARKER": str(marker), "PREFTUNE_TEST_SAVE_STEPS": "4"}
    proc = Proc(tmp_path, out, data_dir, "killed", hook=hook, save_steps=2)
    proc.until(marker.exists, "the save of step 4")
    proc.signal(signal.SIGKILL)
    assert proc.wait() == -signal.SIGKILL
    root = out / "checkpoints"
    assert saved_steps(out) == [2]
    half = [p for p in root.iterdir() if p.name.startswith(ckpt.TMP_PREFIX + "step-4")]
    assert half and (half[0] / ckpt.MANIFEST).exists()  # complete-looking, but never published
    resumed = Proc(tmp_path, out, data_dir, "resumed", save_steps=2)
    assert resumed.wait() == EXIT_OK, resumed.text()[-3000:]
    assert "step-2 (step 2)" in resumed.text()
    assert not [p for p in root.iterdir() if p.name.startswith(ckpt.TMP_PREFIX)]
    assert_same_run(cli_reference, out)


def test_second_signal_during_the_save_does_not_corrupt_it(cli_reference, data_dir, tmp_path):
    out, marker = tmp_path / "run", tmp_path / "saving"
    hook = {"PREFTUNE_TEST_SAVE_MARKER": str(marker), "PREFTUNE_TEST_SAVE_PAUSE": "2"}
    proc = Proc(tmp_path, out, data_dir, "twice", hook=hook, save_steps=0)  # the only save: preemption's
    proc.until(lambda: n_records(out) >= 2, "2 records")
    proc.signal(signal.SIGTERM)
    proc.until(marker.exists, "the preemption save")
    proc.signal(signal.SIGTERM)
    proc.signal(signal.SIGINT)
    assert proc.wait() == EXIT_PREEMPTED, proc.text()[-3000:]
    assert "again: already stopping (saving)" in proc.text()
    (step,) = saved_steps(out)
    assert ckpt.verify(out / "checkpoints" / f"step-{step}") is None
    resumed = Proc(tmp_path, out, data_dir, "resumed", save_steps=0)
    assert resumed.wait() == EXIT_OK, resumed.text()[-3000:]
    assert_same_run(cli_reference, out)


# ---------------------------------------------------------------- in process


def test_signal_during_setup_stops_at_once_without_a_checkpoint(data_dir, tmp_path, monkeypatch, capsys):
    import preftune.model.load as models

    load = models.load_model  # what `Parallel.load` calls
    trained = []

    def load_then_signal(*args, **kwargs):
        model = load(*args, **kwargs)
        os.kill(os.getpid(), signal.SIGTERM)
        return model

    monkeypatch.setattr(models, "load_model", load_then_signal)
    monkeypatch.setattr(loop.Run, "_one_step", lambda *a: trained.append(1))
    cfg = write_config(tmp_path / "run.yaml")
    assert main(["train", str(cfg), *overrides("online", tmp_path / "run", data_dir)]) == EXIT_PREEMPTED
    assert "during setup" in capsys.readouterr().err
    assert not trained and saved_steps(tmp_path / "run") == []
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handlers restored


def test_sigint_is_handled_like_sigterm(data_dir, tmp_path, monkeypatch):
    build = loop.build_task

    def patched(*args, **kwargs):
        task = build(*args, **kwargs)
        inner = task.step

        def step_fn(model, n, stop):
            out = inner(model, n, stop)
            if n == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return out

        task.step = step_fn
        return task

    monkeypatch.setattr(loop, "build_task", patched)
    from preftune.config import load_config

    with pytest.raises(Preempted, match="step-2 saved"):
        loop.train(load_config(None, overrides("online", tmp_path / "run", data_dir, save_steps=0)))
    assert saved_steps(tmp_path / "run") == [2]


def test_preempted_right_after_a_scheduled_save_does_not_save_twice(data_dir, tmp_path, monkeypatch):
    from preftune.config import load_config

    sigterm_during(monkeypatch, 2)
    saves = []
    real = ckpt.save
    monkeypatch.setattr(ckpt, "save", lambda root, step, *a, **k: saves.append(step) or real(root, step, *a, **k))
    with pytest.raises(Preempted, match="nothing new since the last checkpoint"):
        loop.train(load_config(None, overrides("online", tmp_path / "run", data_dir, save_steps=2)))
    assert saves == [2]


def test_grace_period_rules():
    stop = Preemption(grace_seconds=0.2)
    with stop:
        stop.check()  # no signal: never abandons
        stop.training()
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested
        since = stop.since
        stop.check()  # within the first half of the grace period: finish the step
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.since == since  # a second signal changes nothing
        time.sleep(0.12)
        with pytest.raises(StepAbandoned):
            stop.check()
        assert stop.remaining() < 0.1
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
