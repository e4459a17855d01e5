"""`python -m preftune`: the same process as the `preftune` command."""
import preftune.entry  # noqa: F401, I001 - first: the signal handler before any other import

from preftune.entry import main

main()
