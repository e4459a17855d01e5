"""A run that knows it is complete, checked before torch is imported.

A run is complete when `final/` was published at step `max_steps`: its `MANIFEST.json` (written
last, the folder renamed into place) says the step, its `preftune.yaml` the config. With
`checkpoint_uri` the remote copy decides (a fresh node has no local one; a local `final/` whose
upload never finished is not done). The same command run again then exits 0 at once and touches
nothing; a larger `max_steps` continues from the end checkpoint every run keeps (`Run._finish`).
A complete run started again with a config changed in what shapes training is refused as a resume
is (`resume.check_changes`: exit 78 listing the keys), never reported "already complete".
"""
from __future__ import annotations

import logging
from pathlib import Path

import yaml

from preftune.config import Config
from preftune.config.fields import TRAJECTORY
from preftune.errors import Unavailable
from preftune.run import checkpoint_folders as ckpt
from preftune.run.mirror import RemoteMirror
from preftune.run.resume import CONFIG_FILE, check_changes

log = logging.getLogger("preftune")
FINAL = "final"


def _is_complete(manifest_text: str, config_text: str, cfg: Config, where: str) -> bool:
    """final/ is at max_steps; a UserError when the config changed since in what shapes training."""
    try:
        manifest = ckpt.read_manifest(manifest_text)
        saved = yaml.safe_load(config_text)
    except (ValueError, yaml.YAMLError):
        return False
    if manifest.get("step") != cfg.max_steps or not isinstance(saved, dict):
        return False
    changes = check_changes(saved, cfg, f"the finished run {where}")
    if any(c.kind == TRAJECTORY for c in changes):
        log.warning("the changes apply to no step: the run ended "
                    "at max_steps %d (raise it to continue)", cfg.max_steps)
    return True


def _local(final: Path, cfg: Config) -> bool:
    try:
        manifest, config = (final / ckpt.MANIFEST).read_text(), (final / CONFIG_FILE).read_text()
    except OSError:
        return False
    return _is_complete(manifest, config, cfg, str(final))


def _remote(cfg: Config) -> bool:
    mirror = RemoteMirror(cfg.checkpoint_uri, timeout=cfg.checkpoint_uri_timeout_seconds)
    try:
        manifest, config = mirror.read_text(FINAL,
                                            ckpt.MANIFEST), mirror.read_text(FINAL, CONFIG_FILE)
    # not there, or an unreachable remote: not known complete
    except (OSError, UnicodeDecodeError, Unavailable) as e:
        if isinstance(e, Unavailable):
            log.warning("%s; going on as if the run were not complete", e)
        return False
    return _is_complete(manifest, config, cfg, f"{cfg.checkpoint_uri.rstrip('/')}/{FINAL}")


def completed(cfg: Config) -> str | None:
    """Where the complete outputs are (a one-line description), or None when there is work left.
    `resume: never` always starts over (its own rules decide whether it may)."""
    if cfg.resume == "never":
        return None
    final = Path(cfg.output_dir) / FINAL
    if cfg.checkpoint_uri:
        return (
            f"{cfg.checkpoint_uri.rstrip('/')}/{FINAL} (step {cfg.max_steps})"
            if _remote(cfg)
            else None
        )
    return f"{final} (step {cfg.max_steps})" if _local(final, cfg) else None
