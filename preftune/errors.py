"""User-facing errors and the exit-code table.

Each error the CLI knows prints one line (no traceback) and exits with its code; anything else
is a crash (exit 1). What a restart policy should do with each (docs/reliability.md):

  0   done                                       nothing
  75  stopped, nothing lost: run again           restart (preempted and saved; a damaged checkpoint
                                                 set aside; another process's lock went stale)
  69  a service the run needs is unreachable     restart, counted against a retry limit (checkpoint
      (checkpoint_uri, a tracker)                storage at start with nothing local, uploads of
                                                 the last checkpoint or final/, a tracker)
  78  config or data error, or the output_dir    abort: a restart meets the same problem
      is another live process's
  1   crash                                      restart, counted
  3   `preftune eval`: the checkpoint failed     do not promote the model; nothing to retry (the
      its gate (eval.json says why)              evaluation itself worked)
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_CRASH = 1
# BSD EX_UNAVAILABLE: checkpoint storage or a tracker unreachable; retry later
EXIT_UNAVAILABLE = 69
EXIT_PREEMPTED = 75  # BSD EX_TEMPFAIL: interrupted, checkpoint saved, resume me
EXIT_USER = 78  # BSD EX_CONFIG: config or data error
# `preftune eval`: the evaluation worked and the checkpoint failed its gate (not a crash)
EXIT_GATE_FAILED = 3


class UserError(Exception):
    """A config or data error: one line that names the problem and where (file, row, key)."""

    exit_code = EXIT_USER

    def __init__(self, message: str, *, where: str | None = None):
        self.where, self.message = where, message
        super().__init__(f"{where}: {message}" if where else message)


class TryAgain(Exception):
    """Stopped with nothing lost; running the same command again continues (exit 75)."""

    exit_code = EXIT_PREEMPTED


class Preempted(TryAgain):
    """Raised by the training loop after a signal-triggered checkpoint was saved."""


class CheckpointDamaged(TryAgain):
    """A checkpoint that passed its manifest but whose contents do not read as preftune's: it is
    set aside, and a restart resumes from the one before (exit 75)."""


class Unavailable(Exception):
    """A service the run needs (checkpoint storage, a tracker) could not be reached (exit 69)."""

    exit_code = EXIT_UNAVAILABLE


# the errors that end a run with one line and their own code
KNOWN = (UserError, TryAgain, Unavailable)


def same_error(kind: str, message: str) -> Exception:
    """The error named `kind` (a class in KNOWN, by name) with `message`: raised on every rank when
    one rank met it, so all of them exit with its code."""
    classes = {c.__name__: c for c in (UserError, TryAgain, Preempted,
                                       CheckpointDamaged, Unavailable)}
    return classes.get(kind, UserError)(message)


def one_line(exc: BaseException, *, with_type: bool = False, limit: int = 300) -> str:
    """An exception as one short line (whitespace collapsed) for a UserError message."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text}" if with_type else text
