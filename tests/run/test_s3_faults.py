"""checkpoint_uri that fails or hangs, with real `preftune train` processes and a local S3 behind a
proxy the test breaks (tests/s3_server.py): every wait has a bound and every exit code tells the
truth. A run whose end checkpoint or final/ did not reach the bucket exits 69 (retryable, counted),
never 0; an unreachable S3 at start resumes from local checkpoints, or exits 69 with one line; a
hung S3 after the last step ends the run within checkpoint_uri_timeout_seconds (69), or, after a
SIGTERM, within the grace period (75)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from preftune.errors import EXIT_OK, EXIT_PREEMPTED, EXIT_UNAVAILABLE
from tests.distributed.ranks import DRIVER, ROOT
from tests.run.test_resume import data_dir, one_thread, overrides, saved_steps, write_config  # noqa: F401
from tests.s3_server import Proxy, s3_server

pytest.importorskip("s3fs")
pytest.importorskip("moto")


@pytest.fixture(scope="module")
def s3():
    with s3_server(bucket="faults") as endpoint:
        yield endpoint


@pytest.fixture
def proxy(s3):
    with Proxy(s3.endpoint_url) as p:
        yield p


def start(tmp: Path, out: Path, data_dir: Path, proxy: Proxy, uri: str, name: str, *, pause: float = 0.0, **extra):
    driver = tmp / "driver.py"
    driver.write_text(DRIVER)
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", PREFTUNE_TEST_STEP_PAUSE=str(pause),
               AWS_ENDPOINT_URL=proxy.url, AWS_ENDPOINT_URL_S3=proxy.url, AWS_MAX_ATTEMPTS="2",
               AWS_RETRY_MODE="standard")
    o = {"max_steps": 4, "save_steps": 1, "checkpoint_uri": uri, **extra}
    log = tmp / f"{name}.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, str(driver), "train", str(write_config(tmp / "run.yaml")),
                              *overrides("online", out, data_dir, **o)],
                             stdout=f, stderr=subprocess.STDOUT, cwd=tmp, env=env)
    return p, log


def until(cond, p, log, what: str, timeout: float = 240) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert p.poll() is None and time.monotonic() < end, f"never saw {what}:\n{log.read_text()[-3000:]}"
        time.sleep(0.1)


def last_line(log: Path) -> str:
    return log.read_text().strip().splitlines()[-1]


def no_traceback(log: Path) -> None:
    assert "Traceback" not in log.read_text(), log.read_text()[-3000:]


def test_s3_stopped_mid_run_is_not_a_success_and_the_rerun_uploads(s3, proxy, data_dir, tmp_path):
    uri, fs, out = s3.url("stopped"), s3.filesystem(), tmp_path / "run"
    p, log = start(tmp_path, out, data_dir, proxy, uri, "first", pause=1.0)
    until(lambda: fs.exists(f"{s3.bucket}/stopped/step-1/MANIFEST.json"), p, log, "step-1 in the bucket")
    proxy.mode = "down"
    assert p.wait(300) == EXIT_UNAVAILABLE, log.read_text()[-3000:]
    line = last_line(log)
    assert "the run finished at step 4" in line and "did not reach" in line and "run again" in line, line
    assert (out / "final" / "model.safetensors").is_file()
    no_traceback(log)
    proxy.mode = "pass"
    again, log2 = start(tmp_path, out, data_dir, proxy, uri, "again")
    assert again.wait(300) == EXIT_OK, log2.read_text()[-3000:]
    fs.invalidate_cache()
    assert fs.exists(f"{s3.bucket}/stopped/final/MANIFEST.json")
    assert fs.exists(f"{s3.bucket}/stopped/step-4/MANIFEST.json")  # the end checkpoint, sent again


def test_s3_unreachable_at_start(s3, proxy, data_dir, tmp_path):
    """Nothing local: 69 with one line. Local checkpoints: resumed from, and the end says 69."""
    uri, out = s3.url("unreachable"), tmp_path / "run"
    proxy.mode = "down"
    p, log = start(tmp_path, out, data_dir, proxy, uri, "fresh")
    assert p.wait(300) == EXIT_UNAVAILABLE, log.read_text()[-3000:]
    assert "no local checkpoint to resume from" in last_line(log) and uri in last_line(log), last_line(log)
    no_traceback(log)
    assert not out.exists()  # left as found
    proxy.mode = "pass"
    p, log = start(tmp_path, out, data_dir, proxy, uri, "first", pause=1.0)
    until(lambda: (out / "checkpoints" / "step-2").is_dir(), p, log, "step-2")
    p.send_signal(signal.SIGTERM)
    assert p.wait(300) == EXIT_PREEMPTED, log.read_text()[-3000:]
    proxy.mode = "down"
    p, log = start(tmp_path, out, data_dir, proxy, uri, "local")
    assert p.wait(300) == EXIT_UNAVAILABLE, log.read_text()[-3000:]
    assert "resumed from" in log.read_text() and "did not reach" in last_line(log), log.read_text()[-3000:]
    no_traceback(log)


def test_s3_hung_at_start_is_bounded(s3, proxy, data_dir, tmp_path):
    proxy.mode = "hang"
    t0 = time.monotonic()
    p, log = start(tmp_path, tmp_path / "run", data_dir, proxy, s3.url("hung-start"), "hung",
                   checkpoint_uri_timeout_seconds=5)
    assert p.wait(300) == EXIT_UNAVAILABLE, log.read_text()[-3000:]
    assert "no answer in 5 s" in last_line(log), last_line(log)
    assert time.monotonic() - t0 < 120  # start-up + two bounded remote calls, not botocore's minutes


@pytest.mark.parametrize("signalled", [False, True])
def test_s3_hung_after_the_last_step(s3, proxy, data_dir, tmp_path, signalled):
    """Without a signal the wait ends after checkpoint_uri_timeout_seconds (69); with a SIGTERM then,
    within the grace period (75)."""
    uri, fs, out = s3.url(f"hung-end-{signalled}"), s3.filesystem(), tmp_path / "run"
    bound, grace = (300, 12) if signalled else (6, 60)
    p, log = start(tmp_path, out, data_dir, proxy, uri, "hung", pause=1.0, checkpoint_uri_timeout_seconds=bound,
                   preemption_grace_seconds=grace)
    until(lambda: fs.exists(f"{s3.bucket}/hung-end-{signalled}/step-1/MANIFEST.json"), p, log, "step-1 in the bucket")
    proxy.mode = "hang"
    until(lambda: "waiting for the uploads" in log.read_text(), p, log, "the wait for the uploads")
    t0 = time.monotonic()
    if signalled:
        p.send_signal(signal.SIGTERM)
        assert p.wait(grace + 5) == EXIT_PREEMPTED, log.read_text()[-3000:]
        assert time.monotonic() - t0 < grace
    else:
        assert p.wait(bound + 30) == EXIT_UNAVAILABLE, log.read_text()[-3000:]
        assert "did not finish in 6 s" in last_line(log), last_line(log)
    no_traceback(log)
