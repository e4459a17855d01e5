"""Atomic checkpoints with a manifest, retention, verification, and an optional remote (fsspec) mirror.

A checkpoint folder `checkpoints/step-N/` holds the model in Hugging Face format (loadable by
`from_pretrained`), `trainer_state.pt` (plain tensors/containers only, read with weights_only=True),
and `MANIFEST.json` (every file's size and sha256), written last. The folder is built under a
temporary name, fsync'd, then renamed, so a SIGKILL at any moment leaves only complete checkpoints.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger("preftune")
MANIFEST = "MANIFEST.json"
STEP_RE = re.compile(r"^step-(\d+)$")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_tree(root: Path) -> None:
    for p in sorted(root.rglob("*")):
        if p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()]]:
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_manifest(folder: Path, step: int) -> None:
    files = {str(p.relative_to(folder)): {"size": p.stat().st_size, "sha256": _sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    tmp = folder / (MANIFEST + ".tmp")
    tmp.write_text(json.dumps({"step": step, "files": files}, indent=1))
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, folder / MANIFEST)


def verify(folder: Path) -> str | None:
    """None when the folder matches its manifest, else what is wrong (one line)."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return "no readable MANIFEST.json"
    for name, meta in manifest["files"].items():
        p = folder / name
        if not p.is_file():
            return f"{name} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{name} has {p.stat().st_size} bytes, manifest says {meta['size']}"
        if _sha256(p) != meta["sha256"]:
            return f"{name} checksum does not match the manifest"
    return None


def list_checkpoints(ckpt_root: Path) -> list[tuple[int, Path]]:
    """Finished checkpoint folders (by name), newest first; temporary folders are not listed."""
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if p.is_dir() and (m := STEP_RE.match(p.name))]
    return sorted(found, reverse=True)


def newest_valid(ckpt_root: Path) -> Path | None:
    """The newest checkpoint whose files match its manifest; damaged ones are skipped with a warning."""
    for _, path in list_checkpoints(ckpt_root):
        problem = verify(path)
        if problem is None:
            return path
        log.warning("skipping damaged checkpoint %s: %s", path, problem)
    return None


def clean_stale(ckpt_root: Path) -> None:
    """Remove temporary folders left by a save that was killed."""
    if ckpt_root.is_dir():
        for p in ckpt_root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def save(ckpt_root: Path, step: int, write_files, *, keep: int | None = None) -> Path:
    """Build a checkpoint with `write_files(tmp_folder)`, then publish it atomically as step-N."""
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step-{step}"
    tmp = ckpt_root / f".tmp-step-{step}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    write_files(tmp)
    write_manifest(tmp, step)
    _fsync_tree(tmp)
    if final.exists():  # a re-save of the same step (e.g. preempted right after a scheduled save)
        shutil.rmtree(final)
    os.replace(tmp, final)
    fd = os.open(ckpt_root, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    if keep:
        for _, old in list_checkpoints(ckpt_root)[keep:]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def save_state(folder: Path, state: dict) -> None:
    torch.save(state, folder / "trainer_state.pt")


def load_state(folder: Path) -> dict:
    return torch.load(folder / "trainer_state.pt", weights_only=True, map_location="cpu")


class RemoteMirror:
    """Copies each completed local checkpoint to an fsspec URL in a background thread, manifest last,
    so a remote folder with a manifest is complete. The training step only waits for the previous
    upload when the next one is due."""

    def __init__(self, uri: str):
        import fsspec

        self.uri = uri.rstrip("/")
        self.fs, self.root = fsspec.core.url_to_fs(self.uri)
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def upload(self, folder: Path) -> None:
        self.wait()
        self.thread = threading.Thread(target=self._upload, args=(folder,), daemon=True)
        self.thread.start()

    def _upload(self, folder: Path) -> None:
        try:
            dest = f"{self.root}/{folder.name}"
            files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != MANIFEST)
            for p in files + [folder / MANIFEST]:
                self.fs.put_file(str(p), f"{dest}/{p.relative_to(folder).as_posix()}")
        except BaseException as e:  # noqa: BLE001 - reported by wait()
            self.error = e

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        if self.error is not None:
            err, self.error = self.error, None
            log.warning("checkpoint upload to %s failed: %s", self.uri, err)

    def download_newest(self, ckpt_root: Path) -> Path | None:
        """Fetch the newest remote checkpoint that has a manifest and verifies locally."""
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return None
        steps = sorted(((int(m.group(1)), n) for n in names if (m := STEP_RE.match(n))), reverse=True)
        for _, name in steps:
            src = f"{self.root}/{name}"
            if not self.fs.exists(f"{src}/{MANIFEST}"):
                continue
            tmp = ckpt_root / f".tmp-download-{name}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
            manifest = json.loads(self.fs.cat_file(f"{src}/{MANIFEST}"))
            for rel in manifest["files"]:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(f"{src}/{rel}", str(tmp / rel))
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
            problem = verify(tmp)
            if problem is None:
                os.replace(tmp, ckpt_root / name)
                return ckpt_root / name
            log.warning("skipping damaged remote checkpoint %s: %s", src, problem)
            shutil.rmtree(tmp, ignore_errors=True)
        return None
