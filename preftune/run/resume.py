"""Where a run starts: fresh, the newest complete local checkpoint, a remote one, or a given path.

resume=auto   the newest local checkpoint that matches its manifest (damaged ones are set aside as
              checkpoints/damaged-step-N with a warning); with none, the newest complete one at
              checkpoint_uri; with none, a fresh start.
resume=never  a fresh start; refuses a non-empty output_dir (or remote checkpoints) unless
              overwrite_output_dir, which deletes them.
resume=PATH   that checkpoint folder, which must match its manifest.
A checkpoint whose config differs in what matters (MUST_MATCH) is refused with the differences.
"""
from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import yaml

from preftune.config import Config, to_dict
from preftune.config.redact import redact
from preftune.data import memory
from preftune.errors import Unavailable, UserError, one_line
from preftune.rewards import CALLABLE_PREFIX
from preftune.run import checkpoint as ckpt
from preftune.run.lock import LOCK

log = logging.getLogger("preftune")
CONFIG_FILE = "preftune.yaml"  # the run config, inside each checkpoint
STEP_FILES = (*ckpt.state_files(), CONFIG_FILE)  # what every step checkpoint holds

# What a resume may not change: the model, the algorithm, the batch shape, and what the data is
# and its order (a data position means nothing against another data set). Anything else may change
# (max_steps, save_steps, logging, eval, lr, loss options, ...).
MUST_MATCH = ("algorithm", "seed", "model.name_or_path", "model.dtype", "model.lora",
              "data.train", "data.prompt_column", "data.response_column", "data.reward_column",
              "data.shuffle", "data.reward_range", "data.invalid", "data.duplicates", "data.min_reward_threshold",
              "data.max_prompt_length", "data.prompt_truncation", "data.chosen_min", "data.rejected_max",
              "data.pair_strategy", "data.max_pairs_per_prompt", "data.min_margin", "data.tools",
              "grpo.rollout", "grpo.prompts_per_step", "grpo.num_generations", "grpo.num_iterations",
              "dpo.batch_size", "dpo.loss_type", "kto.batch_size", "kto.loss_type", "kto.max_length",
              "sft.min_reward", "sft.max_length", "sft.batch_size", "sft.assistant_only_loss", "eval.split")
_PATH_KEYS = (("model", "name_or_path"), ("data", "train"))


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part) if isinstance(d, dict) else None
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


def _python_rewards(d: dict, key: str) -> list[str]:
    return [s for s in _get(d, key) or () if isinstance(s, str) and s.startswith(CALLABLE_PREFIX)]


def checkpoint_config(cfg: Config) -> str:
    return yaml.safe_dump(comparable(to_dict(cfg)), sort_keys=False)


def config_differences(saved: dict, cfg: Config) -> list[str]:
    saved, now = comparable(saved), comparable(to_dict(cfg))
    diffs = [f"{k}: {_get(saved, k)!r} -> {_get(now, k)!r}" for k in MUST_MATCH if _get(saved, k) != _get(now, k)]
    # named rewards may change on a resume; Python functions must be handed again, the same ones
    for key in ("grpo.reward_funcs", "eval.reward_funcs"):
        was, then = _python_rewards(saved, key), _python_rewards(now, key)
        if was != then:
            diffs.append(f"{key} (Python functions): {was!r} -> {then!r}")
    return diffs


def check_compatible(folder: Path, cfg: Config) -> None:
    try:
        saved = yaml.safe_load((folder / CONFIG_FILE).read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UserError(f"checkpoint has no readable {CONFIG_FILE}: {one_line(e)}", where=str(folder)) from None
    diffs = config_differences(saved if isinstance(saved, dict) else {}, cfg)
    if diffs:
        raise UserError(f"refusing to resume from {folder}: the config differs in what matters: " + "; ".join(diffs)
                        + " (use another output_dir, or resume=never with overwrite_output_dir=true)")


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
        where = f"output_dir {out} is not empty" if _non_empty(out) else f"{cfg.checkpoint_uri} holds checkpoints"
        raise UserError(f"{where} and resume=never; set overwrite_output_dir=true to start over there "
                        "(or resume=auto to continue)", where="resume")
    log.warning("resume=never with overwrite_output_dir: deleting %s%s", out,
                f" and the checkpoints at {cfg.checkpoint_uri}" if remote else "")
    if not (out / LOCK).exists():
        shutil.rmtree(out, ignore_errors=True)
    for p in _contents(out):  # all but this run's lock
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() and not p.is_symlink() else p.unlink(missing_ok=True)
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
