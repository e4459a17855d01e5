"""Atomic checkpoints with a manifest, retention, verification, and an optional remote (fsspec)
mirror.

A checkpoint folder `checkpoints/step-N/` holds the model in Hugging Face format (loadable by
`from_pretrained`), `trainer_state.json` + `.safetensors` (data only: preftune/tensorfile.py), the
run config, the metrics so far, and `MANIFEST.json` (every file's size and sha256), written last.
The folder is built under a temporary name, fsync'd, then renamed, so a SIGKILL at any moment
leaves only complete checkpoints.

Checkpoints are data only: nothing in one is unpickled or imported. A folder is used only when every
file in it is listed in its manifest with that size and hash, its JSON parses and its safetensors
headers fit their files (`verify`); anything else sets it aside with a line saying why. The
manifest detects damage and foreign files, not a writer who rewrites it too: such a writer can
change the weights (data), never run code.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import shutil
import struct
from pathlib import Path

from preftune.atomic import atomic_write
from preftune.errors import CheckpointDamaged

log = logging.getLogger("preftune")
MANIFEST = "MANIFEST.json"
STATE = "trainer_state"  # trainer_state.json + trainer_state.safetensors
STEP_RE = re.compile(r"^step-(\d+)$")
# written beside a published checkpoint by `preftune eval`; never read by a restore
ANNOTATIONS = ("eval.json",)
# everything under checkpoints/ with this prefix is scratch, removed at start-up
TMP_PREFIX = ".tmp-"
_counter = itertools.count()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_files(paths) -> None:
    for p in paths:
        with open(p, "rb") as f:
            os.fsync(f.fileno())


def fsync_tree(root: Path, *, files: bool = True) -> None:
    if files:
        fsync_files(p for p in sorted(root.rglob("*")) if p.is_file())
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        _fsync_dir(d)


def file_entries(folder: Path, names: list[str] | None = None) -> dict:
    """Size and sha256 of `names` (relative to folder; default: every file but the manifest)."""
    if names is None:
        names = content_files(folder)
    return {n: {"size": (folder / n).stat().st_size, "sha256": _sha256(folder / n)} for n in names}


def content_files(folder: Path) -> list[str]:
    return [
        p.relative_to(folder).as_posix()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
        and p.name != MANIFEST
        and p.relative_to(folder).as_posix() not in ANNOTATIONS
    ]


def write_manifest(folder: Path, step: int, files: dict | None = None) -> None:
    """MANIFEST.json, written last; `files` are entries hashed elsewhere (by each rank, in
    parallel)."""
    files = file_entries(folder) if files is None else dict(sorted(files.items()))
    atomic_write(folder / MANIFEST,
                 json.dumps({"step": step, "files": files}, indent=1), fsync=True)


def _safe_rel(name: str) -> bool:
    """A manifest entry must stay inside its folder (a remote manifest is untrusted input)."""
    parts = Path(name).parts
    return bool(parts) and not Path(name).is_absolute() and ".." not in parts


def read_manifest(text: str) -> dict:
    """Parsed manifest, or ValueError when it is not one."""
    m = json.loads(text)
    files = m.get("files") if isinstance(m, dict) else None
    if not isinstance(files, dict) or not all(
        _safe_rel(k) and isinstance(v, dict) for k, v in files.items()
    ):
        raise ValueError("not a preftune manifest")
    return m


def verify(folder: Path, required: tuple[str, ...] = ()) -> str | None:
    """None when the folder matches its manifest, else what is wrong (one line): a file missing,
    not listed, a link, of another size or hash, JSON that does not parse, a safetensors file whose
    header does not fit it. `required`: names the manifest must list."""
    try:
        manifest = read_manifest((folder / MANIFEST).read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return "no readable MANIFEST.json"
    listed = manifest["files"]
    for name in required:
        if name not in listed:
            return f"no {name} (not a checkpoint of this preftune version)"
    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_symlink():
            return f"{rel} is a symbolic link"
        if p.is_file() and rel != MANIFEST and rel not in listed and rel not in ANNOTATIONS:
            return f"{rel} is not listed in the manifest"
    for name, meta in listed.items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta.get("size"):
            return f"{name} has {p.stat().st_size} bytes, manifest says {meta.get('size')}"
        if _sha256(p) != meta.get("sha256"):
            return f"{name} checksum does not match the manifest"
        problem = readable(p)
        if problem:
            return f"{name}: {problem}"
    return None


def readable(path: Path) -> str | None:
    """For the formats preftune reads: None when `path` parses, else why not (JSON; JSON lines of
    objects with a step; safetensors headers, checked against the file without reading the
    tensors)."""
    try:
        if path.suffix == ".json":
            json.loads(path.read_text())
        elif path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if not all(isinstance(r, dict) and isinstance(r.get("step"), int) for r in rows):
                return "not JSON lines of metrics records"
    except (UnicodeDecodeError, ValueError) as e:
        return f"not valid JSON ({type(e).__name__})"
    return _check_safetensors(path) if path.suffix == ".safetensors" else None


SAFETENSORS_DTYPES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1,
                      "I16": 2, "U16": 2, "F16": 2,
                      "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def _check_safetensors(path: Path) -> str | None:
    """The header parses and every tensor's bytes lie inside the file and fit its shape and
    dtype."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 100_000_000:
                return "not a safetensors file (its header is implausibly large)"
            header = json.loads(f.read(n))
        body = path.stat().st_size - 8 - n
        for name, meta in header.items():
            if name == "__metadata__":
                continue
            lo, hi = meta["data_offsets"]
            size = SAFETENSORS_DTYPES[meta["dtype"]]
            for d in meta["shape"]:
                size *= d
            if not (0 <= lo <= hi <= body) or hi - lo != size:
                return f"tensor {name!r} does not fit the file"
    except (OSError, struct.error, ValueError, KeyError, TypeError, AttributeError) as e:
        return f"not a safetensors file ({type(e).__name__})"
    return None


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Published checkpoint folders (by name), newest first; temporary folders are not listed."""
    if not ckpt_root.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in ckpt_root.iterdir()
        if p.is_dir() and (m := STEP_RE.match(p.name))
    ]
    return sorted(found, reverse=True)


def clean_stale(ckpt_root: Path) -> None:
    """Remove scratch folders (half-built checkpoints, upload snapshots) left by a killed run."""
    if ckpt_root.is_dir():
        for p in ckpt_root.glob(TMP_PREFIX + "*"):
            shutil.rmtree(p, ignore_errors=True)


def scratch(ckpt_root: Path, what: str) -> Path:
    """A fresh scratch folder name under checkpoints/ (unique within and across processes)."""
    return ckpt_root / f"{TMP_PREFIX}{what}-{os.getpid()}-{next(_counter)}"


def publish(tmp: Path, final: Path) -> None:
    """Rename a finished folder to its final name. A folder already there (a re-save of the same
    step, or a damaged copy) is moved aside first: directories cannot be replaced in one rename."""
    old = None
    if final.exists():
        old = scratch(final.parent, f"replaced-{final.name}")
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def save(ckpt_root: Path, step: int, write_files, *, keep: int | None = None) -> Path:
    """Build a checkpoint with `write_files(tmp_folder)`, then publish it atomically as step-N,
    and keep only the newest `keep` checkpoints (by step)."""
    tmp = begin(ckpt_root, step)
    write_files(tmp)
    write_manifest(tmp, step)
    fsync_tree(tmp)
    return finish(ckpt_root, tmp, step, keep=keep)


def begin(ckpt_root: Path, step: int) -> Path:
    """A fresh scratch folder for the checkpoint of `step`."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    tmp = scratch(ckpt_root, f"step-{step}")
    tmp.mkdir()
    return tmp


def finish(ckpt_root: Path, tmp: Path, step: int, *, keep: int | None = None) -> Path:
    """Publish a written, manifested, fsync'd scratch folder as step-N; apply retention."""
    final = ckpt_root / f"step-{step}"
    publish(tmp, final)
    if keep:
        for _, old in list_checkpoints(ckpt_root)[keep:]:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def state_files(name: str = STATE) -> tuple[str, str]:
    return f"{name}.json", f"{name}.safetensors"


def save_state(folder: Path, state: dict, name: str = STATE) -> None:
    # here, not at the top: the completion check reads manifests without torch
    from preftune import tensorfile

    tensorfile.save(folder / name, state)


def load_state(folder: Path, name: str = STATE) -> dict:
    """Trainer state: data only (JSON and safetensors), nothing unpickled."""
    from preftune import tensorfile

    try:
        return tensorfile.load(folder / name)
    except tensorfile.TensorFileError as e:
        raise CheckpointDamaged(f"{folder}: {e}") from None


def set_aside(path: Path, problem: str) -> Path:
    """Rename a damaged checkpoint damaged-step-N (kept for inspection, never listed again), so
    retention and later resumes only see checkpoints of the timeline being continued."""
    aside = path.with_name(f"damaged-{path.name}")
    log.warning("skipping damaged checkpoint %s: %s (moved to %s)", path, problem, aside.name)
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    return aside


def snapshot(folder: Path, dest: Path) -> Path:
    """A frozen copy of a finished folder: hard links (instant, no extra space) where the filesystem
    allows, else copies. Deleting the original later (retention) leaves the snapshot whole."""
    for p in sorted(folder.rglob("*")):
        target = dest / p.relative_to(folder)
        if p.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(p, target)
        except OSError:
            shutil.copy2(p, target)
    return dest
