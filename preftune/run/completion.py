"""A run that knows it is complete, checked before torch is imported.

A run is complete when `final/` was published at step `max_steps` under a config that matches in
what matters (`resume.MUST_MATCH`): its `MANIFEST.json` (written last, the folder renamed into
place) says the step, its `preftune.yaml` the config. With `checkpoint_uri` the remote copy
decides (a fresh node has no local one; a local `final/` whose upload never finished is not done).
The same command run again then exits 0 at once and touches nothing; a larger `max_steps`
continues from the end checkpoint every run keeps (`Run._finish`).
"""
from __future__ import annotations

import logging
from pathlib import Path

import yaml

from preftune.config import Config
from preftune.errors import Unavailable
from preftune.run import checkpoint as ckpt
from preftune.run.mirror import RemoteMirror
from preftune.run.resume import CONFIG_FILE, config_differences

log = logging.getLogger("preftune")
FINAL = "final"


def _is_complete(manifest_text: str, config_text: str, cfg: Config) -> bool:
    try:
        manifest = ckpt.read_manifest(manifest_text)
        saved = yaml.safe_load(config_text)
    except (ValueError, yaml.YAMLError):
        return False
    return (manifest.get("step") == cfg.max_steps and isinstance(saved, dict)
            and not config_differences(saved, cfg))


def _local(final: Path, cfg: Config) -> bool:
    try:
        return _is_complete((final / ckpt.MANIFEST).read_text(), (final / CONFIG_FILE).read_text(), cfg)
    except OSError:
        return False


def _remote(cfg: Config) -> bool:
    mirror = RemoteMirror(cfg.checkpoint_uri, timeout=cfg.checkpoint_uri_timeout_seconds)
    try:
        return _is_complete(mirror.read_text(FINAL, ckpt.MANIFEST), mirror.read_text(FINAL, CONFIG_FILE), cfg)
    except (OSError, UnicodeDecodeError, Unavailable) as e:  # not there, or an unreachable remote: not known complete
        if isinstance(e, Unavailable):
            log.warning("%s; going on as if the run were not complete", e)
        return False


def completed(cfg: Config) -> str | None:
    """Where the complete outputs are (a one-line description), or None when there is work left.
    `resume: never` always starts over (its own rules decide whether it may)."""
    if cfg.resume == "never":
        return None
    final = Path(cfg.output_dir) / FINAL
    if cfg.checkpoint_uri:
        return f"{cfg.checkpoint_uri.rstrip('/')}/{FINAL} (step {cfg.max_steps})" if _remote(cfg) else None
    return f"{final} (step {cfg.max_steps})" if _local(final, cfg) else None
