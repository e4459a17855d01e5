"""Where a run starts: fresh, the newest complete local checkpoint, a remote one, or a given path."""
from __future__ import annotations

import logging
import shutil
from pathlib import Path

import yaml

from preftune.config import Config, to_dict
from preftune.errors import UserError
from preftune.train import checkpoint as ckpt

log = logging.getLogger("preftune")

# A resume may change anything else (max_steps, save_steps, logging, lr schedule length, ...).
MUST_MATCH = ("algorithm", "seed", "model.name_or_path", "model.dtype", "model.lora", "data.train",
              "data.prompt_column", "data.response_column", "data.reward_column", "data.shuffle",
              "grpo.rollout", "grpo.prompts_per_step", "grpo.num_generations", "grpo.num_iterations",
              "dpo.batch_size", "dpo.loss_type")


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
    return d


def check_compatible(saved_yaml: str, cfg: Config, folder: Path) -> None:
    saved, now = yaml.safe_load(saved_yaml), to_dict(cfg)
    diffs = [f"{k}: {_get(saved, k)!r} -> {_get(now, k)!r}" for k in MUST_MATCH if _get(saved, k) != _get(now, k)]
    if diffs:
        raise UserError(f"refusing to resume from {folder}: the config differs in what matters: " + "; ".join(diffs)
                        + " (use another output_dir, or resume=never with overwrite_output_dir=true)")


def _non_empty(out: Path) -> bool:
    return out.is_dir() and any(out.iterdir())


def find_resume_point(cfg: Config, out: Path, ckpt_root: Path, mirror) -> Path | None:
    if cfg.resume == "never":
        if _non_empty(out):
            if not cfg.overwrite_output_dir:
                raise UserError(f"output_dir {out} is not empty and resume=never; set overwrite_output_dir=true "
                                "to start over there", where="resume")
            shutil.rmtree(out)
        return None
    if cfg.resume != "auto":
        folder = Path(cfg.resume)
        problem = ckpt.verify(folder)
        if problem:
            raise UserError(f"cannot resume from {folder}: {problem}", where="resume")
        return folder
    found = ckpt.newest_valid(ckpt_root)
    if found is None and mirror is not None:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        found = mirror.download_newest(ckpt_root)
        if found is not None:
            log.info("fetched checkpoint %s from %s", found.name, cfg.checkpoint_uri)
    return found
