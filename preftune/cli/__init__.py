"""The `preftune` command: `command.py` parses and dispatches (its `script` is the console script),
one module per command group beside it."""
