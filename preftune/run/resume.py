"""Where a run starts: fresh, the newest complete local checkpoint, a remote one, or a given path.

resume=auto   the newest local checkpoint that matches its manifest (damaged ones are set aside as
              checkpoints/damaged-step-N with a warning); with none, the newest complete one at
              checkpoint_uri; with none, a fresh start.
resume=never  a fresh start; refuses a non-empty output_dir (or remote checkpoints) unless
              overwrite_output_dir, which deletes them.
resume=PATH   that checkpoint folder, which must match its manifest.
Every key of the config is compared with the one the checkpoint was saved under (its preftune.yaml);
what a change means is declared with the key (config/schema.py, `resume=`): FREE changes are logged,
TRAJECTORY changes are refused unless `resume_with_changes` (then logged and recorded in
OUTPUT_DIR/config_history.jsonl), FIXED changes are refused always.
"""
from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import yaml

from preftune.config import Config, to_dict
from preftune.config.fields import FIXED, TRAJECTORY, on_resume
from preftune.config.redact import redact
from preftune.data import in_memory as memory
from preftune.errors import Unavailable, UserError, one_line
from preftune.run import checkpoint_folders as ckpt
from preftune.run.lock import LOCK

log = logging.getLogger("preftune")
CONFIG_FILE = "preftune.yaml"  # the run config, inside each checkpoint
STEP_FILES = (*ckpt.state_files(), CONFIG_FILE)  # what every step checkpoint holds

ON_RESUME = on_resume(Config)  # every key: FREE, TRAJECTORY or FIXED (declared in config/schema.py)
_PATH_KEYS = (("model", "name_or_path"), ("data", "train"))
# OUTPUT_DIR: one record per resume that went on with a changed config
HISTORY = "config_history.jsonl"
_UNSET = object()


def _get(d: dict, dotted: str, missing=None):
    for part in dotted.split("."):
        d = d.get(part, missing) if isinstance(d, dict) else missing
    return d


def comparable(d: dict) -> dict:
    """The config dict as checkpoints hold it: credentials redacted (config/redact.py), local
    model/data paths made absolute, so a run started from another working directory (paths
    resolve beside the config file) still matches."""
    d = redact(d)
    for section, key in _PATH_KEYS:
        v = d.get(section, {}).get(key)
        if isinstance(v, str) and v and "://" not in v and not memory.is_memory(v):
            d[section][key] = os.path.abspath(v)
    return d


def checkpoint_config(cfg: Config) -> str:
    return yaml.safe_dump(comparable(to_dict(cfg)), sort_keys=False)


@dataclass(frozen=True)
class Change:
    key: str
    old: object
    new: object
    kind: str  # FREE, TRAJECTORY or FIXED

    def __str__(self) -> str:
        return f"{self.key}: {self.old!r} -> {self.new!r}"


def config_changes(saved: dict, cfg: Config) -> list[Change]:
    """Every key whose value in `cfg` differs from the saved config, in declaration order. A key the
    saved config lacks (written by an older preftune) counts as its default then."""
    saved, now, default = comparable(saved), comparable(to_dict(cfg)), to_dict(Config())
    changes = []
    for key, kind in ON_RESUME.items():
        old = _get(saved, key, _UNSET)
        old = _get(default, key) if old is _UNSET else old
        if old != _get(now, key):
            changes.append(Change(key, old, _get(now, key), kind))
    return changes


def refused(changes: list[Change], cfg: Config) -> list[Change]:
    """The changes a resume may not go on with: FIXED always, TRAJECTORY without
    resume_with_changes."""
    return [
        c
        for c in changes
        if c.kind == FIXED or (c.kind == TRAJECTORY and not cfg.resume_with_changes)
    ]


def refusal(what: str, changes: list[Change], cfg: Config) -> UserError:
    """One line naming the refusal, one line per changed key (old -> new), then the ways forward."""
    lines = [
        f"{c}{' (fixed: cannot change on a resume)' if c.kind == FIXED else ''}" for c in changes
    ]
    ways = ["a new output_dir",
            f"resume=never overwrite_output_dir=true (start over in {cfg.output_dir})"]
    if all(c.kind == TRAJECTORY for c in changes):
        ways.append(f"resume_with_changes=true (go on with the change; recorded in {HISTORY})")
    return UserError("\n".join([f"refusing to resume {what}: the config "
                                "changed in what shapes training:",
                                *(f"  {line}" for line in lines),
                                "to go on: " + ", or ".join(ways)]))


def read_saved(folder: Path) -> dict:
    try:
        saved = yaml.safe_load((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(f"checkpoint has no readable {CONFIG_FILE}: {one_line(e)}",
                        where=str(folder)) from None
    return saved if isinstance(saved, dict) else {}


def check_changes(saved: dict, cfg: Config, what: str) -> list[Change]:
    """Raise the refusal for changes a resume may not go on with; log the others and return them."""
    changes = config_changes(saved, cfg)
    bad = refused(changes, cfg)
    if bad:
        raise refusal(what, bad, cfg)
    for c in changes:
        if c.kind == TRAJECTORY:
            log.warning("resuming %s with a changed %s (resume_with_changes)", what, c)
        else:
            log.info("resuming %s with a changed %s", what, c)
    return changes


def check_compatible(folder: Path, cfg: Config) -> list[Change]:
    return check_changes(read_saved(folder), cfg, f"from {folder}")


def record_changes(out: Path, folder: Path, step: int, cfg: Config) -> None:
    """Append what this resume changed against its checkpoint's config to
    OUTPUT_DIR/config_history.jsonl."""
    changes = config_changes(read_saved(folder), cfg)
    if not changes:
        return
    record = {"time": datetime.now(timezone.utc).isoformat(timespec="seconds"), "step": step,
              "checkpoint": str(folder), "resume_with_changes": cfg.resume_with_changes,
              "changes": {c.key: {"from": c.old, "to": c.new, "kind": c.kind} for c in changes}}
    with open(out / HISTORY, "a") as f:
        f.write(json.dumps(record) + "\n")


def newest_valid(ckpt_root: Path) -> Path | None:
    """The newest local checkpoint matching its manifest. Damaged newer ones are renamed
    damaged-step-N (kept for inspection, never listed again) so retention and later resumes
    only ever see checkpoints of the timeline being continued."""
    for _, path in ckpt.list_checkpoints(ckpt_root):
        problem = ckpt.verify(path, STEP_FILES) or _config_problem(path)
        if problem is None:
            return path
        ckpt.set_aside(path, problem)
    return None


def _config_problem(folder: Path) -> str | None:
    try:
        saved = yaml.safe_load((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        return f"{CONFIG_FILE} is not readable YAML ({type(e).__name__})"
    return None if isinstance(saved, dict) else f"{CONFIG_FILE} is not a config"


def _contents(out: Path) -> list[Path]:
    """What is in output_dir besides this run's own lock file."""
    return [p for p in out.iterdir() if p.name != LOCK] if out.is_dir() else []


def _non_empty(out: Path) -> bool:
    return bool(_contents(out))


def _start_fresh(cfg: Config, out: Path, mirror) -> None:
    remote = mirror.remote_steps() if mirror is not None else []
    if not (_non_empty(out) or remote):
        return
    if not cfg.overwrite_output_dir:
        where = (
            f"output_dir {out} is not empty"
            if _non_empty(out)
            else f"{cfg.checkpoint_uri} holds checkpoints"
        )
        raise UserError(f"{where} and resume=never; set overwrite_output_dir=true to start over "
                        "there (or resume=auto to continue)", where="resume")
    log.warning("resume=never with overwrite_output_dir: deleting %s%s", out,
                f" and the checkpoints at {cfg.checkpoint_uri}" if remote else "")
    if not (out / LOCK).exists():
        shutil.rmtree(out, ignore_errors=True)
    for p in _contents(out):  # all but this run's lock
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(
            missing_ok=True
        )
    if remote:
        mirror.clear()


def find_resume_point(cfg: Config, out: Path, ckpt_root: Path, mirror) -> Path | None:
    """The checkpoint to resume from (checked against the config), or None for a fresh start."""
    if cfg.resume == "never":
        _start_fresh(cfg, out, mirror)
        return None
    if cfg.resume != "auto":
        found = Path(cfg.resume)
        problem = ckpt.verify(found, STEP_FILES)
        if problem:
            raise UserError(f"cannot resume from {found}: {problem}", where="resume")
    else:
        found = newest_valid(ckpt_root)  # local first: an unreachable remote does not stop a resume
        if found is None and mirror is not None:
            ckpt_root.mkdir(parents=True, exist_ok=True)
            try:
                found = mirror.download_newest(ckpt_root, STEP_FILES)
            except Unavailable as e:
                raise Unavailable(f"no local checkpoint to resume from, and {e}; run again when "
                                  f"{cfg.checkpoint_uri} is reachable") from None
            if found is not None:
                log.info("fetched checkpoint %s from %s", found.name, cfg.checkpoint_uri)
    if found is not None:
        check_compatible(found, cfg)
    return found
