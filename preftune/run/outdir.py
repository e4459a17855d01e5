"""Leave output_dir as it was found when a run stops before its first optimizer step.

Setup validates what it can before writing (config, model folder, data, reward functions, eval
set), but some problems only show when code runs: a reward function that raises on the first
batch, or at the step-0 evaluation. By then config.yaml, metrics.jsonl, data_report.json or the
DPO reference cache may exist, and `resume: never` would refuse the folder. The guard records the
folder before setup and, on any exception before the first step, removes what the run created and
puts back the top-level files it replaced. Two things it does not undo: `overwrite_output_dir`
(the user asked for the deletion) and moves inside `checkpoints/` (damaged checkpoints set aside).
It never removes `final/` (a run that stops before its first step has not written one), and it
undoes nothing when `may_roll_back()` says no: the run lock (run/lock.py) went to another process,
so what is new in the folder may be that process's.
"""
from __future__ import annotations

import contextlib
import filecmp
import logging
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("preftune")
# managed by run/checkpoint_folders.py and resume.py; never rolled back
KEEP = ("checkpoints", "final")


class OutputGuard:
    def __init__(self, out: Path, may_roll_back=lambda: True):
        self.out, self.may_roll_back = Path(out), may_roll_back
        self.existed = self.out.is_dir()
        self.committed = False
        self.before: set[Path] = set()
        self.backup: Path | None = None
        if self.existed:
            self.before = {p.relative_to(self.out) for p in self.out.rglob("*")}
            self.backup = Path(tempfile.mkdtemp(prefix="preftune-outdir-"))
            for p in self.out.iterdir():
                if p.is_file() and not p.is_symlink():
                    shutil.copy2(p, self.backup / p.name)

    def __enter__(self) -> OutputGuard:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not self.committed and self.may_roll_back():
            with contextlib.suppress(OSError):  # never hide the error that stopped the run
                self.rollback()
        self.commit()

    def commit(self) -> None:
        """The first step is done: what is in output_dir now belongs to the run."""
        self.committed = True
        if self.backup is not None:
            shutil.rmtree(self.backup, ignore_errors=True)
            self.backup = None

    def rollback(self) -> None:
        if not self.out.exists():
            return
        if not self.existed:
            shutil.rmtree(self.out)
            log.info("removed %s: the run stopped before its first step", self.out)
            return
        new = [p for p in self.out.rglob("*") if p.relative_to(self.out) not in self.before
               and p.relative_to(self.out).parts[0] not in KEEP]
        for p in sorted(new, key=lambda p: len(p.parts), reverse=True):  # children before parents
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        for saved in self.backup.iterdir() if self.backup else []:
            target = self.out / saved.name
            if not (target.is_file() and filecmp.cmp(saved, target, shallow=False)):
                shutil.copy2(saved, target)
        log.info("restored %s as it was: the run stopped before its first step", self.out)
