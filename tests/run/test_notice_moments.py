"""A spot notice at every moment of a real `preftune` process's life, from the instant its handler
exists to after `done.`: the exit code is always 75 (work left, what is needed saved) or 0 (outputs
complete), never 143; what is on disk is complete; and a resume after a 75 ends bitwise equal to the
uninterrupted run. Moments are tied to what the process has reached (its log, its files), plus a
few fixed delays; processes run a few at a time to keep the file near a minute. Also: a finished
run restarted exits 0 at once without importing torch or touching a file."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from preftune.errors import EXIT_OK, EXIT_PREEMPTED
from preftune.run import checkpoint_folders as ckpt
from tests.run.test_resume import (  # noqa: F401 - fixtures used by name
    assert_same_run, data_dir, one_thread, overrides, saved_steps, small_eval, write_config,
)

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 6
CONCURRENT = 4
LAUNCHERS = {  # the three ways to start the process; each must handle a signal from its first line
    "module": ["-m", "preftune"],
    "cli": ["-m", "preftune.cli"],
    "script": ["-c", "import sys; from preftune.cli.command import script; sys.exit(script())"],  # what pip's script does
}
# a driver that waits after main() returns (the process is then "exiting"), so a signal lands there surely
LINGER = ("import preftune.run.preemption as p; p.install_process_handler(); import sys, time, pathlib; from preftune.cli.command import main; rc = main(sys.argv[2:]); "
          "pathlib.Path(sys.argv[1]).write_text('x'); time.sleep(3); sys.exit(rc)")
# the completion check must not need torch: report what was imported
NO_TORCH = ("import preftune.run.preemption as p; p.install_process_handler(); import sys; from preftune.cli.command import main; rc = main(sys.argv[1:]); "
            "print('torch imported' if 'torch' in sys.modules else 'torch not imported'); sys.exit(rc)")


def start(tmp: Path, out: Path, data: Path, name: str, launcher: list[str], *pre: str) -> tuple[subprocess.Popen, Path]:
    cfg = write_config(tmp / "run.yaml")
    ovr = overrides("online", out, data, max_steps=MAX_STEPS, save_steps=0, **{"data.eval": small_eval(data)})
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    log = tmp / f"{name}.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, *launcher, *pre, "train", str(cfg), *ovr], stdout=f,
                             stderr=subprocess.STDOUT, env=env, cwd=tmp)
    return p, log


def handler_installed(pid: int) -> bool:
    """SIGTERM is caught (its bit in /proc/PID/status SigCgt)."""
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1)


def wait_for(p: subprocess.Popen, cond, timeout: float = 300) -> bool:
    """Poll until cond() holds; False when the process ended first."""
    end = time.monotonic() + timeout
    while not cond():
        if p.poll() is not None:
            return False
        if time.monotonic() > end:
            p.kill()
            raise AssertionError("timed out")
        time.sleep(0.005)
    return True


def log_has(log: Path, text: str):
    return lambda: text in log.read_text()


def installed(p, log, out) -> bool:
    return wait_for(p, lambda: handler_installed(p.pid))


def after(seconds: float, first=installed):
    def when(p, log, out) -> bool:
        if not first(p, log, out):
            return False
        time.sleep(seconds)
        return True

    return when


def logged(text: str):
    return lambda p, log, out: wait_for(p, lambda: text in log.read_text())


def exists(rel: str):
    return lambda p, log, out: wait_for(p, (out / rel).exists)


# name: (launcher, when to signal (waits; False if the process ended first), the exit codes allowed)
MOMENTS = {
    "handler-installed": ("module", installed, {75}),
    "handler-installed-cli": ("cli", installed, {75}),
    "handler-installed-script": ("script", installed, {75}),
    "50ms": ("module", lambda p, log, out: time.sleep(0.05) or installed(p, log, out), {75}),
    "importing": ("module", after(0.4), {75}),
    "setup": ("module", logged("data: "), {75}),
    "first-step": ("module", logged("startup "), {75}),
    "training": ("module", lambda p, log, out: wait_for(p, lambda: n_records(out) >= 4), {75}),
    "finishing": ("module", exists(f"checkpoints/step-{MAX_STEPS}"), {0}),
    "done": ("module", logged("done."), {0}),
}


def n_records(out: Path) -> int:
    path = out / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def signal_at(tmp: Path, data: Path, name: str) -> tuple[str, int, Path, str]:
    launcher, when, _ = MOMENTS[name]
    out = tmp / name
    p, log = start(tmp, out, data, name, LAUNCHERS[launcher])
    if when(p, log, out):
        p.send_signal(signal.SIGTERM)
    rc = p.wait(300)
    return name, rc, out, log.read_text()


def check_outputs(rc: int, out: Path, text: str) -> None:
    """What a process left: a 75 left no final/ and only complete checkpoints; a 0 the final model."""
    if rc == EXIT_PREEMPTED:
        assert not (out / "final").exists(), text[-2000:]
        for step in saved_steps(out):
            assert ckpt.verify(out / "checkpoints" / f"step-{step}") is None
    else:
        assert ckpt.verify(out / "final") is None and saved_steps(out) == [MAX_STEPS]


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_dir) -> Path:
    tmp = tmp_path_factory.mktemp("ref")
    p, log = start(tmp, tmp / "run", data_dir, "ref", LAUNCHERS["module"])
    assert p.wait(300) == EXIT_OK, log.read_text()[-3000:]
    return tmp / "run"


def test_a_notice_at_any_moment_gives_75_or_0_and_resumes_exactly(reference, data_dir, tmp_path):
    with ThreadPoolExecutor(CONCURRENT) as pool:
        results = list(pool.map(lambda n: signal_at(tmp_path, data_dir, n), MOMENTS))
    resumes = []
    for name, rc, out, text in results:
        expected = MOMENTS[name][2]
        assert rc in expected, f"{name}: exit {rc}, expected {expected}; log:\n{text[-3000:]}"
        check_outputs(rc, out, text)
        if name.startswith(("handler", "50ms", "importing")):  # nothing touched yet: a resume is a fresh start
            assert not out.exists() and "during start-up; nothing was written" in text, text[-2000:]
        elif rc == EXIT_PREEMPTED:
            resumes.append((name, out))
        else:
            assert_same_run(reference, out)

    def resume(item):
        name, out = item
        p, log = start(tmp_path, out, data_dir, f"{name}-resumed", LAUNCHERS["module"])
        return name, p.wait(300), out, log.read_text()

    with ThreadPoolExecutor(CONCURRENT) as pool:
        for name, rc, out, text in pool.map(resume, resumes):
            assert rc == EXIT_OK, f"{name} resumed: exit {rc}; log:\n{text[-3000:]}"
            assert_same_run(reference, out)


def test_a_notice_after_main_returned_changes_nothing(reference, data_dir, tmp_path):
    """Here main() found the run complete; a driver then lingers, so the notice surely lands after."""
    marker = tmp_path / "returned"
    p, log = start(tmp_path, reference, data_dir, "linger", ["-c", LINGER, str(marker)])
    assert wait_for(p, marker.exists)
    p.send_signal(signal.SIGTERM)
    p.send_signal(signal.SIGINT)
    assert p.wait(60) == EXIT_OK, log.read_text()[-3000:]
    assert "received SIGTERM after the run completed: nothing to do" in log.read_text()


def snapshot(folder: Path) -> dict:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*"))}


def test_a_complete_run_restarted_exits_0_at_once_and_touches_nothing(reference, data_dir, tmp_path):
    before = snapshot(reference)
    p, log = start(tmp_path, reference, data_dir, "again", ["-c", NO_TORCH])
    assert p.wait(120) == EXIT_OK, log.read_text()
    lines = log.read_text().splitlines()
    assert len(lines) == 2 and "already complete" in lines[0] and f"(step {MAX_STEPS})" in lines[0], lines
    assert lines[1] == "torch not imported"
    assert snapshot(reference) == before
