"""User-facing errors and the exit-code table.

A `UserError` is a problem with the user's config or data: the CLI prints its one-line message
(no traceback) and exits 78. Anything else is a crash (exit 1). A preempted run that saved a
checkpoint exits 75 so an orchestrator knows to resume it.
"""
from __future__ import annotations

EXIT_OK = 0
EXIT_CRASH = 1
EXIT_PREEMPTED = 75  # BSD EX_TEMPFAIL: interrupted, checkpoint saved, resume me
EXIT_USER = 78  # BSD EX_CONFIG: config or data error


class UserError(Exception):
    """A config or data error: one line that names the problem and where (file, row, key)."""

    exit_code = EXIT_USER

    def __init__(self, message: str, *, where: str | None = None):
        self.where, self.message = where, message
        super().__init__(f"{where}: {message}" if where else message)


class Preempted(Exception):
    """Raised by the training loop after a signal-triggered checkpoint was saved."""

    exit_code = EXIT_PREEMPTED


def one_line(exc: BaseException, *, with_type: bool = False, limit: int = 300) -> str:
    """An exception as one short line (whitespace collapsed) for a UserError message."""
    text = " ".join(str(exc).split())
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    if not text:
        return type(exc).__name__
    return f"{type(exc).__name__}: {text}" if with_type else text
