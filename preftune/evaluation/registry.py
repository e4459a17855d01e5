"""The model registry: one JSON record per promoted checkpoint, append-only.

A local registry is a JSONL file: each record is one `write()` of one line on a file opened with
O_APPEND under an exclusive `flock`, so two gates appending at once both land, whole, and no
earlier line is ever rewritten. Object stores (`s3://…`, any fsspec URL) have no append, and a
read-modify-write of one object loses a record written in between; there each record is its own
new object, `<URL>.d/<time>-<uuid>.json`, and the registry is the union of those (plus `<URL>`
itself when it exists, e.g. a compacted copy), sorted by time.
"""
from __future__ import annotations

import fcntl
import json
import os
import uuid
from datetime import datetime, timezone

from preftune.errors import UserError


def _fs(url: str):
    import fsspec

    try:
        return fsspec.core.url_to_fs(url, skip_instance_cache=True)
    except (ImportError, ValueError) as e:
        raise UserError(f"cannot open registry: {e}", where=url) from None


def _is_local(fs) -> bool:
    from preftune.data.traces import is_local

    return is_local(fs)


def append(url: str, record: dict) -> str:
    """Append `record` (a JSON object); returns where it was written."""
    line = json.dumps(record, sort_keys=True) + "\n"
    fs, path = _fs(url)
    if _is_local(fs):
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, line.encode())
            os.fsync(fd)
        finally:
            os.close(fd)  # also releases the lock
        return path
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%fZ")
    target = f"{path}.d/{stamp}-{uuid.uuid4().hex}.json"
    try:
        with fs.open(target, "wb") as f:  # a new, unique object: nothing existing is touched
            f.write(line.encode())
    except Exception as e:
        raise UserError(
            f"cannot write registry record: {' '.join(str(e).split())[:300]}", where=url
        ) from None
    return fs.unstrip_protocol(target)


def read(url: str) -> list[dict]:
    """Every record, oldest first (by their `time`)."""
    fs, path = _fs(url)
    texts = []
    try:
        if fs.exists(path) and fs.isfile(path):
            texts.append(fs.cat_file(path).decode())
        if not _is_local(fs) and fs.exists(f"{path}.d"):
            texts += [
                fs.cat_file(p).decode() for p in sorted(fs.find(f"{path}.d")) if p.endswith(".json")
            ]
    except Exception as e:
        raise UserError(
            f"cannot read registry: {' '.join(str(e).split())[:300]}", where=url
        ) from None
    records = []
    for text in texts:
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError:
                    raise UserError(f"line {n} is not JSON", where=url) from None
    return sorted(records, key=lambda r: str(r.get("time", "")))


def format_table(records: list[dict]) -> str:
    if not records:
        return "(no records)"
    lines = [f"{'time':<20}  {'reward':>7}  {'improvement':>11}  model"]
    for r in records:
        m = r.get("metrics", {})
        imp = m.get("improvement")
        lines.append(f"{str(r.get('time', ''))[:19]:<20}  {_num(m.get('reward'))}  {_num(imp, 11)} "
                     f" {r.get('model_path', '')}")
    return "\n".join(lines)


def _num(x, width: int = 7) -> str:
    return f"{x:>{width}.3f}" if isinstance(x, (int, float)) else f"{'-':>{width}}"
