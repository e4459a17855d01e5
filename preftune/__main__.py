"""`python -m preftune` (and `torchrun -m preftune train CONFIG`): the CLI."""
import sys

from preftune.cli import main

sys.exit(main())
