"""`startup_seconds`: from the process start (or the `train()` call) to the first step, split into
phases, so the price of each restart after a spot notice is visible in the metrics and the log.

Every moment between the start and the first step belongs to exactly one phase:
imports (interpreter, torch, transformers, preftune; until `train()` begins) · restore (finding
the resume point, downloads, reading the checkpoint into the model, optimizer and task) · model
(tokenizer and policy) · data (data loading and encoding, the reference model or DPO reference
log-probs, the evaluator, the optimizer) · eval (the step-0 evaluation; none on a resume).
"""
from __future__ import annotations

import logging
import os
import time

log = logging.getLogger("preftune")
PHASES = ("imports", "restore", "model", "data", "eval")
STARTUP_KEYS = ("startup_seconds", *(f"startup/{p}" for p in PHASES))


def process_start() -> float | None:
    """Wall-clock time (time.time()) at which this process started, from /proc (Linux), else
    None."""
    try:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        # field 22: start time after boot, in ticks
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - started)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


class StartupClock:
    def __init__(self, start: float | None = None):
        self.start = self.last = time.time() if start is None else start
        self.parts = dict.fromkeys(PHASES, 0.0)

    def mark(self, phase: str) -> None:
        """The time since the previous mark was spent in `phase`."""
        now = time.time()
        self.parts[phase] += now - self.last
        self.last = now

    def metrics(self) -> dict:
        return {"startup_seconds": self.last - self.start,
                **{f"startup/{p}": v for p, v in self.parts.items()}}

    def report(self) -> dict:
        m = self.metrics()
        log.info("startup %.2f s (%s)", m["startup_seconds"],
                 ", ".join(f"{p} {self.parts[p]:.2f}" for p in PHASES))
        return m
