"""bench/bench_churn.py's arithmetic: the start-up line it reads and the goodput it reports (the
churn itself is real processes and belongs to the bench; tests/run/test_notice_moments.py covers
restarts)."""
from __future__ import annotations

import pytest

from bench import bench_churn
from preftune.run.startup import PHASES, StartupClock


def test_reads_the_startup_line_the_run_logs(caplog):
    clock = StartupClock(start=0.0)
    with caplog.at_level("INFO", logger="preftune"):
        m = clock.report()
    parsed = bench_churn.startup("12:00:00 INFO resumed ...\n" + caplog.text)
    assert parsed["total"] == pytest.approx(m["startup_seconds"], abs=0.01)
    assert set(parsed) == {"total", *PHASES}
    assert bench_churn.startup("no such line") is None


def test_goodput_and_seconds_lost_per_interruption():
    seg = {"startup": {"total": 3.0, "imports": 2.0}, "handler_after_s": 0.03}
    churned = {"wall": 80.0, "segments": [{"rc": 75, "signal_to_exit": 1.0, **seg},
                                          {"rc": 75, "signal_to_exit": 0.5, **seg},
                                          {"rc": 0, "signal_to_exit": None, **seg}]}
    r = bench_churn.summarize(60.0, churned)
    assert r["interruptions"] == 2 and r["goodput"] == pytest.approx(0.75)
    assert r["lost_per_interruption_s"] == pytest.approx(10.0) and r["signal_to_exit_s"] == pytest.approx(0.75)
    assert r["restart_startup_s"] == {"total": 3.0, "imports": 2.0} and r["handler_after_s"] == 0.03
