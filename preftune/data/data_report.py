"""data_report.json: what the data loaders kept and dropped, in the run folder and the log (never
silent)."""
from __future__ import annotations

import json
import logging
from pathlib import Path

from preftune.atomic import atomic_write

log = logging.getLogger("preftune")
DATA_REPORT = "data_report.json"


def write_data_report(out_dir: str | Path, report: dict) -> None:
    atomic_write(Path(out_dir) / DATA_REPORT, json.dumps(report, indent=1))
    log.info("data: %s", json.dumps(report))
