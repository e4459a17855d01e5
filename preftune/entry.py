"""The `preftune` process's first line: the console script, `python -m preftune` and
`python -m preftune.cli` all start here, so SIGTERM/SIGINT are handled (exit 75, never 143) before
torch, transformers or anything else heavy is imported. Keep this module and everything it imports
free of heavy imports (tests/train/test_completion.py checks it)."""
from preftune.train.preemption import install_process_handler

install_process_handler()


def main(argv: list[str] | None = None) -> None:
    from preftune.cli import main as cli_main

    finish(cli_main(argv))


def finish(code: int) -> None:
    """Exit the process with `code` without the interpreter's teardown: with torch loaded it takes
    seconds (every restart after a spot notice pays them), and CPython restores the default SIGTERM
    action early in it, so a late notice would turn a finished run into 143. What matters of the
    teardown is done first: exit handlers (logging's flush among them) and the standard streams."""
    import atexit
    import os
    import sys

    try:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)
