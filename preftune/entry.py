"""The `preftune` process's first line: the console script, `python -m preftune` and
`python -m preftune.cli` all start here, so SIGTERM/SIGINT are handled (exit 75, never 143) before
torch, transformers or anything else heavy is imported. Keep this module and everything it imports
free of heavy imports (tests/test_entry.py checks it)."""
from preftune.train.preemption import install_process_handler

install_process_handler()


def main(argv: list[str] | None = None) -> int:
    from preftune.cli import main as cli_main

    return cli_main(argv)
