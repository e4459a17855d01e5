"""SIGTERM/SIGINT handling for spot nodes: stop at the next safe point, save, exit 75.

During setup (loading, reference log-probs, the first evaluation) there is nothing to save, so a
signal stops the run at once. Once training has started the handler only sets a flag: the loop
finishes the step (or abandons it when over half the grace period is gone, so the save fits in the
other half), saves, and exits. A second signal changes nothing, so it cannot interrupt the save
half-way; the checkpoint is atomic against SIGKILL anyway.
"""
from __future__ import annotations

import logging
import signal
import threading
import time

from preftune.errors import Preempted

log = logging.getLogger("preftune")
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StepAbandoned(Exception):
    """Raised inside a step when the grace period is too short to finish it."""


class Preemption:
    def __init__(self, grace_seconds: float):
        self.grace = grace_seconds
        self.requested = False
        self.immediate = True  # setup phase: a signal raises Preempted right away
        self.saving = False
        self.since: float | None = None
        self._old = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if not self.requested:
            self.requested, self.since = True, time.monotonic()
            if self.immediate:
                log.warning("received %s during setup: stopping (nothing to save yet)", name)
                raise Preempted(f"{name} during setup; nothing was trained yet, run again to continue")
            log.warning("received %s: saving a checkpoint at the next safe point", name)
        else:
            log.warning("received %s again: already stopping%s", name, " (saving)" if self.saving else "")

    def training(self) -> None:
        """From here on a signal only sets the flag (there is progress to save)."""
        self.immediate = False

    def elapsed(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def remaining(self) -> float:
        """Seconds of the grace period left (the full period when no signal came)."""
        return self.grace - self.elapsed()

    def check(self) -> None:
        """Called between pieces of a step: abandon it when over half of the grace period is spent."""
        if self.requested and self.elapsed() > self.grace / 2:
            raise StepAbandoned

    def __enter__(self) -> "Preemption":
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._old.items():
            signal.signal(sig, handler)
        self._old.clear()
