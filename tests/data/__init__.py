"""Tests for preftune.data; small writers shared by the data tests."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.parquet as pq


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_csv(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    pa_csv.write_csv(pa.Table.from_pylist(rows), path)
    return path


def rows(*triples) -> list[dict]:
    """[(input, output, final_reward), ...] -> trace rows."""
    return [{"input": p, "output": r, "final_reward": s} for p, r, s in triples]
