"""Spot churn: what each interruption costs. The same `preftune train` command is run once without
interruption, then again under a loop that sends SIGTERM every K seconds of each process's life
and starts the command again whenever it exits 75, until it exits 0.

Reported: the interruptions, the wall time of both, goodput (uninterrupted wall / churned wall),
seconds lost per interruption ((churned - uninterrupted) / interruptions), the mean start-up of a
restart split by phase (the `startup ...` log line, i.e. `startup_seconds`), the time from the
signal to the exit, and whether the final weights are bitwise equal. From the repo root:

    .venv/bin/python bench/bench_churn.py [--interval 10] [--json churn.json] [KEY=VALUE ...]

The default job is examples/grpo.yaml (200 steps, evaluation every 50) with the progress bar off.
Record the machine load with the numbers (printed): on a shared machine they move with it.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
STARTUP_RE = re.compile(r"startup ([\d.]+) s \((.*)\)")


def launch(config: str, out: Path, overrides: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "preftune", "train", config, f"output_dir={out}",
           "log.progress_bar=false", *overrides]
    with open(log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)


def handler_delay(p: subprocess.Popen, start: float) -> float | None:
    """Seconds from the launch until the process catches SIGTERM (Linux /proc), None if unknown."""
    status = Path(f"/proc/{p.pid}/status")
    while p.poll() is None and time.monotonic() - start < 10:
        try:
            line = next(x for x in status.read_text().splitlines() if x.startswith("SigCgt:"))
        except (OSError, StopIteration):
            return None
        if int(line.split()[1], 16) >> (signal.SIGTERM - 1) & 1:
            return time.monotonic() - start
        time.sleep(0.001)
    return None


def startup(text: str) -> dict | None:
    """The `startup 3.10 s (imports 2.0, ...)` line of one process, as numbers."""
    m = STARTUP_RE.search(text)
    if m is None:
        return None
    parts = dict(p.rsplit(" ", 1) for p in m.group(2).split(", "))
    return {"total": float(m.group(1)), **{k: float(v) for k, v in parts.items()}}


def run_once(config: str, out: Path, overrides: list[str], logs: Path) -> float:
    t0 = time.monotonic()
    p = launch(config, out, overrides, logs / "uninterrupted.log")
    if p.wait() != 0:
        raise SystemExit(f"the uninterrupted run failed; see {logs / 'uninterrupted.log'}")
    return time.monotonic() - t0


def churn(config: str, out: Path, overrides: list[str], logs: Path,
          interval: float, limit: int) -> dict:
    """Run with a SIGTERM every `interval` s of each process, restarting on 75, until exit 0."""
    segments, t0 = [], time.monotonic()
    for i in range(limit):
        log = logs / f"segment-{i}.log"
        start = time.monotonic()
        p = launch(config, out, overrides, log)
        handler = handler_delay(p, start)
        signalled = None
        try:
            p.wait(max(0.0, interval - (time.monotonic() - start)))
        except subprocess.TimeoutExpired:
            signalled = time.monotonic()
            p.send_signal(signal.SIGTERM)
        rc = p.wait()
        end = time.monotonic()
        text = log.read_text()
        segments.append({"rc": rc, "wall": end - start,
                         "signal_to_exit": end - signalled if signalled else None,
                         "startup": startup(text),
                         "handler_after_s": handler})
        if rc == 0:
            return {"wall": time.monotonic() - t0, "segments": segments}
        if rc != 75:
            raise SystemExit(f"segment {i} exited {rc}; see {log}")
    raise SystemExit(f"not finished after {limit} processes")


def same_weights(a: Path, b: Path) -> bool:
    from safetensors.torch import load_file

    from preftune.model.hf_files import weight_files

    # final/ is one model.safetensors or sharded files named by their index
    x, y = ({k: v for f in weight_files(d / "final") for k, v in load_file(str(f)).items()}
            for d in (a, b))
    return x.keys() == y.keys() and all(x[k].equal(y[k]) for k in x)


def summarize(uninterrupted: float, churned: dict) -> dict:
    segs = churned["segments"]
    n = sum(1 for s in segs if s["signal_to_exit"] is not None)
    # the first process is a fresh start
    restarts = [s["startup"] for s in segs[1:] if s["startup"]]
    phases = {k: statistics.fmean(r[k] for r in restarts) for k in restarts[0]} if restarts else {}
    exits = [s["signal_to_exit"] for s in segs if s["signal_to_exit"] is not None]
    handler = [s["handler_after_s"] for s in segs if s["handler_after_s"] is not None]
    return {
        "interruptions": n,
        "uninterrupted_s": uninterrupted,
        "churned_s": churned["wall"],
        "goodput": uninterrupted / churned["wall"],
        "lost_per_interruption_s": (churned["wall"] - uninterrupted) / n if n else 0.0,
        "restart_startup_s": phases,
        "signal_to_exit_s": statistics.fmean(exits) if exits else None,
        "handler_after_s": max(handler) if handler else None,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/grpo.yaml")
    ap.add_argument("--interval", type=float, default=10.0,
                    help="seconds of each process's life before its SIGTERM")
    ap.add_argument("--limit", type=int, default=200, help="give up after this many processes")
    ap.add_argument("--json", help="write the numbers (and the load) to this file")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE overrides for both runs")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    # kept when something fails, for its logs
    tmp = Path(tempfile.mkdtemp(prefix="preftune-churn-"))
    t_ref = run_once(args.config, tmp / "uninterrupted", args.overrides, tmp)
    churned = churn(args.config, tmp / "churned", args.overrides, tmp, args.interval, args.limit)
    record = summarize(t_ref, churned) | {
        "bitwise_equal": same_weights(tmp / "uninterrupted", tmp / "churned")
    }
    shutil.rmtree(tmp)
    record |= {"config": args.config, "overrides": args.overrides, "interval_s": args.interval,
               "cpus": os.cpu_count(), "load_avg_before": list(load_before),
               "load_avg_after": list(os.getloadavg()), "segments": churned["segments"]}
    ph = record["restart_startup_s"]
    print(f"{record['interruptions']} interruptions (SIGTERM every {args.interval:g} "
          f"s of each process)\nuninterrupted {t_ref:.1f} s, churned "
          f"{churned['wall']:.1f} s: goodput {record['goodput']:.0%}, "
          f"{record['lost_per_interruption_s']:.1f} s lost per interruption\nrestart "
          "start-up (mean): " + ", ".join(f"{k} {v:.2f}" for k, v in ph.items()) + " "
          f"s\nsignal to exit (mean): {record['signal_to_exit_s'] or 0:.2f} s; SIGTERM handled "
          f"from {(record['handler_after_s'] or 0) * 1000:.0f} ms after the launch (the slowest "
          f"process)\nfinal weights bitwise equal: {record['bitwise_equal']}\nload avg (1/5/15 "
          f"min) before {'/'.join(f'{x:.1f}' for x in load_before)}, after "
          f"{'/'.join(f'{x:.1f}' for x in record['load_avg_after'])} on {os.cpu_count()} CPUs")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main()
