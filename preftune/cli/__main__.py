"""`python -m preftune.cli`: the same process as the `preftune` command."""
from preftune.cli import script

script()
