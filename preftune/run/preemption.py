"""SIGTERM/SIGINT handling for spot nodes: stop at the next safe point, save, exit 75.

One `Preemption` object follows a run through its phases, and a signal means something different
in each (docs/checkpoints.md, "A spot notice, moment by moment"):

- start-up, before anything is touched (imports, argument and config parsing; the `preftune`
  process only): the process writes one line and exits 75 at once (`os._exit`: nothing to save,
  nothing to clean up, no half-imported library to tear down);
- setup (resume point, loading, data, reference log-probs, the step-0 evaluation): nothing to save
  yet, so the handler raises `Preempted` right away and the run unwinds (exit 75);
- training: the handler only sets a flag; the loop finishes the step (or abandons it when over
  half the grace period is gone, so the save fits in the other half), saves, and exits 75;
- finishing (the end checkpoint, the final evaluation, `final/`): finished within the grace, then 0;
- complete: a signal changes nothing (exit 0). A second signal never interrupts a save either.

The `preftune` process installs its handler from its first line (`preftune.cli`) and keeps it
until it exits; a library call (`loop.train`) installs one for the call only and restores the
previous handlers afterwards.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time

from preftune.errors import EXIT_PREEMPTED, Preempted

log = logging.getLogger("preftune")
# SIGHUP (a hangup, a container runtime's stop) and SIGUSR1 (Slurm's --signal warning, some
# runtimes) mean the same as SIGTERM: stop at the next safe point and save; without a handler they
# end the process with 129 / 138 and nothing saved
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1)


class StepAbandoned(Exception):
    """Raised inside a step when the grace period is too short to finish it."""


class Preemption:
    def __init__(self, grace_seconds: float = 60.0, *, exit_at_once: bool = False):
        self.grace = grace_seconds
        self.requested = False
        self.exit_at_once = exit_at_once  # start-up: nothing touched yet, a signal ends the process
        self.immediate = True  # setup phase: a signal raises Preempted right away
        self.saving = False
        self.finished = False  # the run's outputs are complete: a signal changes nothing
        self.since: float | None = None
        # for the line a signal in setup prints
        self.doing, self.unsaved = "setup", "nothing was trained yet"
        self._old = {}

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if self.finished:
            log.info("received %s after the run completed: nothing to do", name)
        elif self.requested:
            log.warning("received %s again: already stopping%s", name,
                        " (saving)" if self.saving else "")
        else:
            self.requested, self.since = True, time.monotonic()
            if self.exit_at_once:  # raw write: no lock or buffer of the interrupted code is touched
                os.write(2,
                         f"preftune: {name} during start-up; nothing "
                         "was written, run again to continue\n".encode())
                os._exit(EXIT_PREEMPTED)
            if self.immediate:
                log.warning("received %s during %s: stopping (nothing to save yet)", name,
                            self.doing)
                raise Preempted(
                    f"{name} during {self.doing}; {self.unsaved}, run again to continue"
                )
            log.warning("received %s: saving a checkpoint at the next safe point", name)

    def setup(self, grace_seconds: float, doing: str = "setup",
              unsaved: str = "nothing was trained yet") -> None:
        """Setup begins (files may be touched from here on): a signal raises Preempted, whose line
        says what was being done and what is not saved."""
        self.grace, self.exit_at_once = grace_seconds, False
        self.doing, self.unsaved = doing, unsaved
        if self.requested and not self.finished:  # a notice that library code swallowed
            raise Preempted("stopped during start-up; nothing was "
                            "trained yet, run again to continue")

    def training(self) -> None:
        """From here on a signal only sets the flag (there is progress to save)."""
        self.immediate = False

    def complete(self) -> None:
        """The run's outputs are complete: from here on a signal changes nothing."""
        self.finished = True

    def elapsed(self) -> float:
        return 0.0 if self.since is None else time.monotonic() - self.since

    def remaining(self) -> float:
        """Seconds of the grace period left (the full period when no signal came)."""
        return self.grace - self.elapsed()

    def check(self) -> None:
        """Called between pieces of a step: abandon it when over half of the grace period is
        spent."""
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


# the `preftune` process's own handler, installed by preftune.cli
_process: Preemption | None = None


def install_process_handler() -> Preemption:
    """For the `preftune` process: from here to its exit, SIGTERM/SIGINT go to one Preemption
    (never restored: a notice after the run completed must not kill the process with 143)."""
    global _process
    if _process is None:
        _process = Preemption(exit_at_once=True).__enter__()
    return _process


def process_handler() -> Preemption | None:
    """The process-wide handler when this is the `preftune` process, else None (library use)."""
    return _process


class SharedStop:
    """The preemption flag as every rank sees it: a signal to any one rank (a spot interruption hits
    one node) stops all of them at the same step boundary or micro-batch. Each query is one small
    all-reduce, so every rank must make the same queries in the same order (the loop does)."""

    def __init__(self, stop, dp):
        self.stop, self.dp = stop, dp

    # everything local (complete, setup, grace, ...) is the handler's
    def __getattr__(self, name: str):
        return getattr(self.stop, name)

    @property
    def requested(self) -> bool:
        return self.dp.any(self.stop.requested)

    @property
    def saving(self) -> bool:
        return self.stop.saving

    @saving.setter
    def saving(self, value: bool) -> None:
        self.stop.saving = value

    def elapsed(self) -> float:
        return self.dp.max(self.stop.elapsed())[0]

    def remaining(self) -> float:
        return self.stop.grace - self.elapsed()

    def check(self) -> None:
        requested, elapsed = self.dp.max(float(self.stop.requested), self.stop.elapsed())
        if requested and elapsed > self.stop.grace / 2:
            raise StepAbandoned
