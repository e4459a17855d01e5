"""Write-then-rename: a reader (or a resumed run) sees the old file or the new one, never half of
one.

The one home for atomic local file writes; checkpoint folders are published by
`run/checkpoint_folders.py` with the same rename rule at folder level.
"""
from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: str | Path, *, fsync: bool = False) -> Iterator[Path]:
    """Yield a temporary path beside `path`; on success it replaces `path`, on error it is
    removed."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def atomic_write(path: str | Path, data: str | bytes, *, fsync: bool = False) -> None:
    """Write text or bytes to `path` atomically."""
    with atomic_path(path, fsync=fsync) as tmp:
        tmp.write_bytes(data.encode() if isinstance(data, str) else data)


def copy_atomic(src: str | Path, dst: str | Path) -> None:
    with atomic_path(dst) as tmp:
        shutil.copyfile(src, tmp)
