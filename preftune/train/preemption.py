"""SIGTERM/SIGINT handling for spot nodes: stop at the next safe point, save, exit 75.

The handler only sets a flag, so a second signal during the save changes nothing and cannot
interrupt the write half-way (the checkpoint is atomic against SIGKILL anyway). A step still
running when half the grace period is gone is abandoned so the save fits in the other half.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

log = logging.getLogger("preftune")


class StepAbandoned(Exception):
    """Raised inside a step when the grace period is too short to finish it."""


class Preemption:
    def __init__(self, grace_seconds: float):
        self.grace = grace_seconds
        self.requested = False
        self.saving = False
        self.since: float | None = None
        self._old = {}

    def _handle(self, signum, frame) -> None:
        if not self.requested:
            self.requested, self.since = True, time.monotonic()
            log.warning("received %s: saving a checkpoint at the next safe point", signal.Signals(signum).name)
        else:
            log.warning("received %s again: already stopping%s", signal.Signals(signum).name,
                        " (saving)" if self.saving else "")

    def check(self) -> None:
        """Called between pieces of a step: abandon it when over half of the grace period is spent."""
        if self.requested and time.monotonic() - self.since > self.grace / 2:
            raise StepAbandoned

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
