"""One writer per run: the lock on output_dir, in process and with two real `preftune train`."""
from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from preftune.cli.command import main
from preftune.errors import EXIT_OK, EXIT_USER, UserError
from preftune.run.lock import LOCK, RunLock
from tests.distributed.ranks import DRIVER, ROOT
from tests.run.test_resume import data_dir, one_thread, overrides, saved_steps, write_config  # noqa: F401


def foreign_lock(out: Path, *, age: float = 0.0) -> dict:
    """A lock written by a process on another node (another pid space), `age` seconds old."""
    out.mkdir(parents=True, exist_ok=True)
    holder = {"host": "node-b", "pid": 1, "space": "node-b/boot/4026531836", "pid_started": "7",
              "token": "f" * 32, "started_at": "2025-01-01T00:00:00+0000"}
    (out / LOCK).write_text(json.dumps(holder) + "\n")
    then = time.time() - age
    os.utime(out / LOCK, (then, then))
    return holder


def test_a_second_holder_in_the_same_pid_space_is_refused_at_once(tmp_path):
    first = RunLock(tmp_path / "run").acquire()
    t0 = time.monotonic()
    with pytest.raises(UserError, match=f"in use by another preftune process .*pid {os.getpid()}, started "):
        RunLock(tmp_path / "run").acquire()
    assert time.monotonic() - t0 < 1.0
    first.release()
    assert not (tmp_path / "run" / LOCK).exists()
    RunLock(tmp_path / "run").acquire().release()


def test_a_lock_of_a_dead_process_on_this_host_is_taken_over(tmp_path, caplog):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = RunLock(tmp_path)
    holder = dict(lock.me, pid=dead.pid, token="0" * 32)
    (tmp_path / LOCK).write_text(json.dumps(holder))
    with caplog.at_level(logging.WARNING, logger="preftune"):
        lock.acquire()
    assert f"its process {dead.pid} is gone" in caplog.text
    assert json.loads((tmp_path / LOCK).read_text())["token"] == lock.token
    lock.release()


def test_a_foreign_lock_without_heartbeat_is_taken_over_after_the_bound(tmp_path, caplog):
    foreign_lock(tmp_path)  # fresh mtime: only the absence of change counts, not the clocks
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="preftune"):
        lock = RunLock(tmp_path, stale_seconds=1.5).acquire()
    assert 1.5 <= time.monotonic() - t0 < 5 and "no heartbeat for 2 s" in caplog.text
    lock.release()


def test_a_foreign_lock_with_a_heartbeat_is_refused(tmp_path):
    foreign_lock(tmp_path, age=3600)
    stop = threading.Event()

    def beat():  # the holder on the other node, touching its lock
        while not stop.wait(0.3):
            os.utime(tmp_path / LOCK)

    threading.Thread(target=beat, daemon=True).start()
    try:
        with pytest.raises(UserError, match="host node-b, pid 1, started 2025-01-01"):
            RunLock(tmp_path, stale_seconds=3).acquire()
    finally:
        stop.set()


def test_a_holder_that_lost_its_lock_stops_and_leaves_the_new_one(tmp_path):
    lock = RunLock(tmp_path, stale_seconds=0.6).acquire()
    lock.check()
    theirs = foreign_lock(tmp_path)
    deadline = time.monotonic() + 5
    while lock.held and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not lock.held  # the heartbeat noticed
    with pytest.raises(UserError, match="taken over by another preftune process .*node-b"):
        lock.check()
    lock.release()
    assert json.loads((tmp_path / LOCK).read_text()) == theirs


# ---------------------------------------------------------------- two real processes


def start(tmp: Path, out: Path, data_dir: Path, name: str, *extra: str, pause: float = 0.0, steps: int = 5, **more):
    driver = tmp / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PREFTUNE_TEST_STEP_PAUSE=str(pause))
    log = tmp / f"{name}.log"
    args = [*overrides("online", out, data_dir, max_steps=steps, save_steps=1, **more), *extra]
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, str(driver), "train", str(write_config(tmp / "run.yaml")), *args],
                             stdout=f, stderr=subprocess.STDOUT, cwd=tmp, env=env)
    return p, log


def wait_for(cond, p, log, what: str, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert p.poll() is None and time.monotonic() < end, f"never saw {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def test_two_preftune_train_on_one_folder(data_dir, tmp_path):
    """The second is refused (78, naming the first) and touches nothing; the first finishes alone;
    killed, its lock is taken over by the next run, which resumes."""
    out = tmp_path / "run"
    a, a_log = start(tmp_path, out, data_dir, "a", pause=2.0, steps=40)  # long enough to meet b
    wait_for(lambda: (out / "checkpoints" / "step-1").is_dir(), a, a_log, "a's step-1 checkpoint")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    b, b_log = start(tmp_path, out, data_dir, "b", steps=40)
    assert b.wait(240) == EXIT_USER, b_log.read_text()[-3000:]
    line = b_log.read_text().strip().splitlines()[-1]
    assert "output_dir is in use by another preftune process" in line and f"pid {a.pid}" in line, line
    assert set(before) <= {p.relative_to(out) for p in out.rglob("*")}  # nothing of a's removed
    a.send_signal(signal.SIGKILL)
    a.wait()
    assert a.returncode == -signal.SIGKILL  # it was still running when b was refused
    c, c_log = start(tmp_path, out, data_dir, "c", steps=40)
    assert c.wait(240) == EXIT_OK, c_log.read_text()[-3000:]
    text = c_log.read_text()
    assert f"its process {a.pid} is gone" in text and "resumed from" in text, text[-3000:]
    assert (out / "final" / "model.safetensors").is_file() and not (out / LOCK).exists()


def test_a_failed_second_run_never_removes_what_the_first_published(data_dir, tmp_path):
    """Issue 25: a second process that failed before its first step "restored the folder as it was"
    and deleted the first one's final/. Now the first finishes, the second (a larger max_steps, a
    reward function that raises on its first batch) fails with 78, and final/ stays."""
    out = tmp_path / "run"
    assert main(["train", str(write_config(tmp_path / "run.yaml")),
                 *overrides("online", out, data_dir, max_steps=2, save_steps=2)]) == EXIT_OK
    final = sorted(p.relative_to(out) for p in (out / "final").rglob("*"))
    (tmp_path / "bad.py").write_text("def bad(completions, **kw):\n    raise ValueError('no')\n")
    rc = main(["train", str(tmp_path / "run.yaml"), *overrides(
        "online", out, data_dir, max_steps=4, save_steps=2, **{"grpo.reward_funcs": f"[{tmp_path / 'bad.py'}:bad]"})])
    assert rc == EXIT_USER
    assert sorted(p.relative_to(out) for p in (out / "final").rglob("*")) == final and not (out / LOCK).exists()
