"""The remote mirror: each completed local checkpoint (and final/) copied to an fsspec URL.

`upload()` only takes a hard-link snapshot of the folder and returns; one background thread
uploads snapshots in order, the manifest last, so a remote folder with a manifest is complete.
When saves outpace the upload, a queued snapshot is replaced by the newer one. After an upload,
remote checkpoints beyond the newest `keep` are deleted (manifest first).

Every wait on the remote has a bound (`timeout`, the config's checkpoint_uri_timeout_seconds): a
listing or a manifest read that fails to connect or takes longer raises `Unavailable` (exit 69),
and `wait()` is given its bound by the caller. What was uploaded and what failed is kept per
folder (`outcome`), so a run knows whether its last checkpoint and final/ reached the remote.
"""
from __future__ import annotations

import json
import logging
import shutil
import threading
from pathlib import Path

from preftune.errors import Unavailable, UserError, one_line
from preftune.run.checkpoint_folders import (
    MANIFEST, STEP_RE, fsync_tree, publish, read_manifest, scratch, snapshot, verify,
)

log = logging.getLogger("preftune")


def bounded(fn, timeout: float, what: str):
    """`fn()` in a helper thread, waited for at most `timeout` s (a hung connection cannot hold
    the run). A failure to connect, or no answer in time, raises Unavailable; FileNotFoundError
    and PermissionError pass through as they are."""
    box: dict = {}

    def call() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
            box["error"] = e

    t = threading.Thread(target=call, name="preftune-remote", daemon=True)
    t.start()
    t.join(timeout)
    if t.is_alive():
        raise Unavailable(f"{what}: no answer in {timeout:.0f} s (checkpoint_uri_timeout_seconds)")
    error = box.get("error")
    if error is None:
        return box.get("value")
    if isinstance(error,
                  (FileNotFoundError, PermissionError, UserError, KeyboardInterrupt, SystemExit)):
        raise error
    raise Unavailable(f"{what}: {one_line(error, with_type=True)}") from None


class RemoteMirror:
    def __init__(self, uri: str, keep: int | None = None, timeout: float = 300.0):
        try:
            import fsspec

            self.fs, self.root = fsspec.core.url_to_fs(uri.rstrip("/"))
        except (ImportError, ValueError) as e:
            raise UserError(f"cannot use {uri}: {e}", where="checkpoint_uri") from None
        self.uri, self.keep, self.timeout = uri.rstrip("/"), keep, timeout
        self.root = self.root.rstrip("/")
        self._cond = threading.Condition()
        self._queued: tuple[Path, str] | None = None
        self._running = False
        self.failures = 0
        self.outcome: dict[str, str | None] = {}  # folder name -> None (uploaded) or why it failed

    # ---------------------------------------------------------------- upload

    def upload(self, folder: Path, *, scratch_root: Path | None = None) -> None:
        """Queue `folder` for upload as URL/<folder name>; the snapshot goes under `scratch_root`
        (default: beside the folder; it must be on the same filesystem for hard links)."""
        name = folder.name
        snap = snapshot(folder, scratch(scratch_root or folder.parent, f"upload-{name}"))
        with self._cond:
            if self._queued is not None:
                log.info("upload of %s superseded by %s", self._queued[1], name)
                shutil.rmtree(self._queued[0], ignore_errors=True)
                self.outcome[self._queued[1]] = "superseded"
            self._queued = (snap, name)
            self.outcome[name] = "queued"
            if not self._running:
                self._running = True
                threading.Thread(target=self._work, name="preftune-upload", daemon=True).start()

    def _work(self) -> None:
        while True:
            with self._cond:
                item, self._queued = self._queued, None
                if item is None:
                    self._running = False
                    self._cond.notify_all()
                    return
            snap, name = item
            try:
                self._put(snap, name)
                if STEP_RE.match(name):
                    self._prune()
                self.outcome[name] = None
                log.info("mirrored %s to %s/%s", name, self.uri, name)
            except Exception as e:  # noqa: BLE001 - an upload failure must not stop training
                self.failures += 1
                self.outcome[name] = one_line(e, with_type=True, limit=200)
                log.warning("checkpoint upload of %s to %s failed: %s", name, self.uri, e)
            finally:
                shutil.rmtree(snap, ignore_errors=True)

    def _put(self, snap: Path, name: str) -> None:
        dest = f"{self.root}/{name}"
        # an older copy of this step: incomplete until re-finished
        if self.fs.exists(f"{dest}/{MANIFEST}"):
            self.fs.rm_file(f"{dest}/{MANIFEST}")
        files = sorted(p for p in snap.rglob("*") if p.is_file() and p.name != MANIFEST)
        if (snap / MANIFEST).is_file():
            files.append(snap / MANIFEST)
        for p in files:
            rel = p.relative_to(snap).as_posix()
            self.fs.makedirs(f"{dest}/{rel}".rsplit("/", 1)[0], exist_ok=True)
            self.fs.put_file(str(p), f"{dest}/{rel}")

    def _prune(self) -> None:
        """Keep the newest `keep` complete remote checkpoints; delete older complete ones and the
        incomplete leftovers (failed uploads) older than the newest complete one."""
        if not self.keep:
            return
        steps = self._steps()
        complete = [s for s, name in steps if self.fs.exists(f"{self.root}/{name}/{MANIFEST}")]
        if not complete:
            return
        kept = set(complete[:self.keep])
        for step, name in steps:
            if step not in kept and step < complete[0]:
                self._rm(f"{self.root}/{name}")

    def _rm(self, path: str) -> None:
        if self.fs.exists(f"{path}/{MANIFEST}"):
            self.fs.rm_file(f"{path}/{MANIFEST}")
        if self.fs.exists(path):
            self.fs.rm(path, recursive=True)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every snapshot is uploaded (or `timeout` seconds pass); True when done."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._running, timeout)

    def mark_uploaded(self, name: str) -> None:
        """`name` is at the remote already (a rerun found it there): nothing to send."""
        self.outcome[name] = None

    def reached(self, name: str) -> str | None:
        """None when `name` was uploaded by this process, else why not."""
        return self.outcome.get(name, "never uploaded")

    def has(self, name: str) -> bool:
        """The remote holds a complete copy of `name` (its manifest)."""
        return bool(bounded(lambda: self.fs.exists(f"{self.root}/{name}/{MANIFEST}"), self.timeout,
                            f"cannot reach {self.uri}"))

    # ---------------------------------------------------------------- listing, download

    def _steps(self) -> list[tuple[int, str]]:
        self.fs.invalidate_cache(self.root)
        try:
            names = [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        return sorted(((int(m.group(1)), n) for n in names if (m := STEP_RE.match(n))),
                      reverse=True)

    def remote_steps(self) -> list[tuple[int, str]]:
        """step-N folders under the URL (complete or not), newest first."""
        try:
            return bounded(self._steps, self.timeout, f"cannot list {self.uri}")
        except PermissionError as e:
            raise UserError(f"cannot list {self.uri}: {e}", where="checkpoint_uri") from None

    def read_text(self, name: str, file: str) -> str:
        """URL/name/file as text (FileNotFoundError when it is not there; bounded)."""
        return bounded(lambda: self.fs.cat_file(f"{self.root}/{name}/{file}").decode(),
                       self.timeout, f"cannot read {self.uri}/{name}/{file}")

    def clear(self) -> None:
        """Delete every remote checkpoint (resume=never with overwrite_output_dir)."""
        for _, name in self.remote_steps():
            bounded(lambda name=name: self._rm(f"{self.root}/{name}"), self.timeout,
                    f"cannot delete in {self.uri}")

    def download_newest(self, ckpt_root: Path, required: tuple[str, ...] = ()) -> Path | None:
        """Fetch the newest remote checkpoint that has a manifest listing every file it holds and
        verifies locally (`verify`); others are skipped with a line saying why."""
        for _, name in self.remote_steps():
            src = f"{self.root}/{name}"
            try:
                manifest = read_manifest(self.read_text(name, MANIFEST))
            except (FileNotFoundError, ValueError, UnicodeDecodeError):
                continue  # an upload that never finished
            found = bounded(lambda src=src: self._remote_files(src),
                            self.timeout, f"cannot list {src}")
            extra = sorted(set(found) - set(manifest["files"]) - {MANIFEST})
            if extra:
                log.warning("skipping remote checkpoint %s: %s is not listed in its manifest", src,
                            extra[0])
                continue
            got = self._fetch(src, name, manifest, ckpt_root, required)
            if got is not None:
                return got
        return None

    def _fetch(self, src: str, name: str, manifest: dict, ckpt_root: Path, required) -> Path | None:
        tmp = scratch(ckpt_root, f"download-{name}")
        tmp.mkdir(parents=True)
        try:
            for rel in manifest["files"]:
                (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                self.fs.get_file(f"{src}/{rel}", str(tmp / rel))
        except FileNotFoundError as e:
            log.warning("skipping incomplete remote checkpoint %s: %s", src, e)
            shutil.rmtree(tmp, ignore_errors=True)
            return None
        except Exception as e:  # noqa: BLE001 - the connection went during the download
            shutil.rmtree(tmp, ignore_errors=True)
            raise Unavailable(f"cannot download {src}: {one_line(e, with_type=True)}") from None
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
        problem = verify(tmp, required)
        if problem is None:
            fsync_tree(tmp)
            publish(tmp, ckpt_root / name)
            return ckpt_root / name
        log.warning("skipping damaged remote checkpoint %s: %s", src, problem)
        shutil.rmtree(tmp, ignore_errors=True)
        return None

    def _remote_files(self, src: str) -> list[str]:
        """Every file under a remote folder, relative to it."""
        self.fs.invalidate_cache(src)
        return [p[len(src.rstrip("/")) + 1:] for p in self.fs.find(src)]
