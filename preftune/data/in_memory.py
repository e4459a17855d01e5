"""In-memory tables handed to `preftune.train(train_data=..., eval_data=...)`, read like files.

A Hugging Face `datasets.Dataset`, a pandas DataFrame or a list of dicts becomes rows and columns as
a file reader would give them (DataFrames and Datasets through Arrow, as their parquet files would
read), registered under a name such as `in-memory:train_data@3f2a9c0d1b7e6a54`. That name takes the
place of the path in the config (`data.train`), so the loaders validate the rows exactly as a file's
(errors read `train_data row 3 column output: ...`, drops are counted the same), `config.yaml`
records it, and its hash of the content is what a resume compares, as it compares a file's path.
The name means something only inside the `preftune.train()` call that registered it.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from preftune.errors import UserError, one_line

PREFIX = "in-memory:"
# spec -> (rows, columns), while train() runs
TABLES: dict[str, tuple[list[dict], list[str] | None]] = {}


def is_memory(path: Any) -> bool:
    return isinstance(path, str) and path.startswith(PREFIX)


def display_name(spec: str) -> str:
    """`in-memory:train_data@<hash>` -> `train_data` (where errors point)."""
    return spec[len(PREFIX):].split("@", 1)[0]


def to_rows(obj: Any, name: str) -> tuple[list[dict], list[str] | None]:
    """(rows, column names) of a Dataset, DataFrame or list of dicts; None names when there are no
    rows."""
    kind = type(obj).__module__.split(".", 1)[0]
    if kind == "pandas" and hasattr(obj, "columns"):
        return _from_pandas(obj, name)
    if kind == "datasets":
        # DatasetDict, IterableDataset
        if not hasattr(obj, "column_names") or not hasattr(obj, "to_list"):
            raise UserError(f"a {type(obj).__name__} is not a table; pass "
                            "one split as a Dataset (e.g. ds['train'])", where=name)
        return obj.to_list(), list(obj.column_names)
    if isinstance(obj, (list, tuple)):
        for i, row in enumerate(obj):
            if not isinstance(row, dict):
                raise UserError(f"row {i}: expected a dict, got {type(row).__name__}", where=name)
        rows = list(obj)
        return rows, list(dict.fromkeys(k for r in rows for k in r)) if rows else None
    raise UserError("expected a datasets.Dataset, a pandas DataFrame "
                    f"or a list of dicts, got {type(obj).__name__}",
                    where=name)


def _from_pandas(df, name: str) -> tuple[list[dict], list[str]]:
    """Through Arrow, as df.to_parquet then reading it would give; a column Arrow cannot hold (mixed
    types) falls back to plain python values, so the bad cell is reported at its row like in
    jsonl."""
    import pyarrow as pa

    columns = [str(c) for c in df.columns]
    try:
        return pa.Table.from_pandas(df, preserve_index=False).to_pylist(), columns
    except (pa.ArrowException, TypeError, ValueError):
        pass
    rows = df.to_dict("records")
    for row in rows:
        for k, v in row.items():
            if type(v).__module__ == "numpy" and hasattr(v, "item"):
                row[k] = v.item()
    if not rows:
        raise UserError(f"cannot read the DataFrame's columns {columns}", where=name)
    return rows, columns


def fingerprint(rows: list[dict], columns: list[str] | None) -> str:
    """sha256 of the columns and every row's canonical JSON: the same content gives the same
    name."""
    h = hashlib.sha256(json.dumps(columns).encode())
    for row in rows:
        h.update(json.dumps(row, sort_keys=True, ensure_ascii=False, default=repr).encode())
        h.update(b"\n")
    return h.hexdigest()[:16]


def register(obj: Any, name: str) -> str:
    """Register a table under `in-memory:<name>@<hash>` and return that name."""
    try:
        rows, columns = to_rows(obj, name)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 -- whatever the object's own conversion raised
        raise UserError(f"cannot read the rows: {one_line(e)}", where=name) from None
    if not rows:
        raise UserError("has no rows", where=name)
    spec = f"{PREFIX}{name}@{fingerprint(rows, columns)}"
    TABLES[spec] = (rows, columns)
    return spec


def _missing(spec: str) -> str:
    return (f"'{spec}' is a table that was handed to preftune.train({display_name(spec)}=...); "
            "pass it again from Python (a command line or a config file cannot)")


def rows(spec: str) -> tuple[list[dict], list[str] | None]:
    if spec not in TABLES:
        raise UserError(_missing(spec), where=display_name(spec))
    return TABLES[spec]


def check_registered(spec: str | None, key: str) -> None:
    """An early, clear error for a config whose data came from Python (e.g. a run's config.yaml)."""
    if is_memory(spec) and spec not in TABLES:
        raise UserError(_missing(spec), where=key)


class MemoryTables:
    """Stands in for an fsspec filesystem in data/traces.py: a registered table is one 'file'."""

    protocol = ("in-memory",)

    @staticmethod
    def unstrip_protocol(spec: str) -> str:
        return display_name(spec)


FS = MemoryTables()
