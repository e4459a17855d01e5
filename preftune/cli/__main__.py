"""`python -m preftune.cli`: the same process as the `preftune` command."""
from preftune.cli.command import script

script()
