"""`python -m preftune.config [PATH]`: write the configuration reference (default
docs/config.md)."""
import sys
from pathlib import Path

from preftune.config import Config, reference

out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/config.md")
out.write_text(reference(Config))
print(f"wrote {out}")
