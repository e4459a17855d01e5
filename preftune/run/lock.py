"""One writer per run: `output_dir/.preftune.lock`, held by the process that writes there (rank 0).

The lock file names its holder (host, pid, start time, a random token) and its modification time
is the holder's heartbeat (touched every `stale_seconds / 6`). A process that finds it:

- the same process space (host, boot, pid namespace): the holder is alive -> exit 78 naming it;
  its pid is gone (or is another process now) -> stale, taken over at once;
- elsewhere (another node, a container, a shared filesystem): the newcomer watches the heartbeat
  for up to `stale_seconds`; it moves -> exit 78 naming the holder; it does not -> taken over.
  Only a change is looked for, so clocks need not agree across hosts.

Taking over renames the stale file aside (one rename wins among racing newcomers) and creates a
new one with O_EXCL. A holder that finds another token in the file has lost the lock: it stops at
its next publish (`check`) with 78 and leaves everything as it is (no rollback, no release).
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import socket
import threading
import time
from pathlib import Path

from preftune.errors import UserError

log = logging.getLogger("preftune")
LOCK = ".preftune.lock"
ALIVE, CHANGED = "alive", "changed"


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def _pid_space() -> str:
    """Where a pid means one process: host, boot and pid namespace."""
    try:
        ns = str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        ns = ""
    return f"{socket.gethostname()}/{_boot_id()}/{ns}"


def _started(pid: int) -> str | None:
    """The start time of `pid` (clock ticks after boot), or None when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except PermissionError:
            pass
        return "?"  # alive, start time unknown


def _mtime(path: Path) -> int | None:
    """The file's mtime (ns), read through an open file (NFS revalidates attributes on open)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)


def _read(path: Path) -> dict | None:
    try:
        holder = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def describe(holder: dict) -> str:
    return (f"host {holder.get('host', '?')}, pid {holder.get('pid', '?')}, started "
            f"{holder.get('started_at', '?')}")


class RunLock:
    def __init__(self, out: Path, stale_seconds: float = 60.0):
        self.out, self.path = Path(out), Path(out) / LOCK
        self.stale = stale_seconds
        self.token = secrets.token_hex(16)
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "space": _pid_space(),
                   "pid_started": _started(os.getpid()), "token": self.token,
                   "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
        self.lost: dict | None = None  # the holder that took the lock from this process
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # ---------------------------------------------------------------- acquire

    def acquire(self) -> RunLock:
        self.out.mkdir(parents=True, exist_ok=True)
        while not self._create():
            holder = _read(self.path)
            if holder is None:
                continue  # released in between: try again
            why, seen = self._stale(holder)
            if why is ALIVE:
                raise UserError("output_dir is in use by another preftune process "
                                f"({describe(holder)}); it holds {self.path}. Use another "
                                "output_dir, or stop that process",
                                where="output_dir")
            if why is not CHANGED:
                self._take_over(holder, why, seen)
        self._thread = threading.Thread(target=self._beat, name="preftune-lock", daemon=True)
        self._thread.start()
        return self

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(json.dumps(self.me) + "\n")
            f.flush()
            os.fsync(f.fileno())
        return True

    def _stale(self, holder: dict) -> tuple[str, int | None]:
        """(why the lock of `holder` is stale, its mtime then) or (ALIVE | CHANGED, None)."""
        pid = holder.get("pid")
        if holder.get("space") == self.me["space"] and isinstance(pid, int):
            started = _started(pid)
            if started is None:
                return f"its process {pid} is gone", _mtime(self.path)
            if holder.get("pid_started") not in (None, "?") and started not in ("?",
                                                                                holder["pid_started"]):
                return f"pid {pid} is another process now", _mtime(self.path)
            return ALIVE, None
        first = _mtime(self.path)
        end = time.monotonic() + self.stale
        log.info("output_dir is locked by %s: watching its heartbeat for up to %.0f s",
                 describe(holder), self.stale)
        while time.monotonic() < end:
            time.sleep(min(1.0, self.stale / 10))
            if _read(self.path) != holder:
                return CHANGED, None  # released or taken by another: look again
            if _mtime(self.path) != first:
                return ALIVE, None
        return f"no heartbeat for {self.stale:.0f} s", first

    def _take_over(self, holder: dict, why: str, seen: int | None) -> None:
        aside = self.path.with_name(f"{LOCK}.stale-{self.token}")
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:  # another newcomer won the rename: compete again
            return
        if _read(aside) != holder or _mtime(aside) != seen:  # fresher than judged: put it back
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
            os.unlink(aside)
            return
        os.unlink(aside)
        log.warning("taking over the lock on %s from %s: %s", self.out, describe(holder), why)

    # ---------------------------------------------------------------- hold

    def _beat(self) -> None:
        while not self._stop.wait(self.stale / 6):
            holder = _read(self.path)
            for _ in range(5):  # gone for a moment: a newcomer renaming it aside to look, then back
                if holder is not None or self._stop.wait(0.2):
                    break
                holder = _read(self.path)
            if holder is not None and holder.get("token") == self.token:
                with contextlib.suppress(OSError):
                    os.utime(self.path)
                continue
            if holder == {}:  # a torn read on a shared filesystem: look again next beat
                continue
            self.lost = holder or {"host": "?", "pid": "?", "started_at": "?"}
            log.error("lost the lock on %s to %s: this process will not publish anything more",
                      self.out, describe(self.lost))
            return

    def check(self) -> None:
        """Raise (exit 78) when another process took the lock: called before each publish."""
        holder = _read(self.path)
        if self.lost is None and (holder is None or (holder and holder.get("token") != self.token)):
            self.lost = holder or {"host": "?", "pid": "?", "started_at": "?"}
        if self.lost is not None:
            raise UserError("output_dir was taken over by another preftune process "
                            f"({describe(self.lost)}); "
                            "stopping without publishing", where="output_dir")

    def release(self) -> None:
        """Remove the lock file if it is still this process's."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        holder = _read(self.path)
        if holder and holder.get("token") == self.token:
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()

    @property
    def held(self) -> bool:
        return self.lost is None
