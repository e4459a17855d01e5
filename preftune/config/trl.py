"""TRL 1.16's names for preftune's keys: the one table, read by the loader, the errors and the docs.

A TRL user writes flat keys (`learning_rate`, `beta`, `logging_steps`) where preftune has sections
(`optim.lr`, `grpo.beta`, `log.logging_steps`). The table is built from the declarations: a key
whose peer reads `TRL <name>` (schema.py) means exactly what TRL's `<name>` means, so `<name>` is
accepted as an alias of it, anywhere in the config (top level or any section). `beta`,
`loss_type` and `max_length` exist in several sections: the alias is the run's algorithm's.
A name in parentheses after it (`TRL vllm_importance_sampling_clip_max
(vllm_importance_sampling_cap)`) is an old TRL name: answered with the key, not accepted.
`CONVERTED` are TRL names that mean a key after a change of value (`bf16: true` is `model.dtype:
bfloat16`); `DIFFERENT` are TRL names whose nearest preftune key means something else: they are
answered with that key and how it differs, never guessed. `TRL_VALUES` are TRL's values that
preftune's keys accept under their own names (`scale_rewards: true`, `report_to: none`, `resume:
true`).
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from preftune.config.fields import keys
from preftune.config.schema import Config
from preftune.errors import UserError

ALGORITHMS = ("grpo", "dpo", "kto", "sft")
_PLAIN = re.compile(r"TRL ([a-z][a-z0-9_]*)(?: \(([a-z][a-z0-9_]*)\))?")


def _report_to(value: Any) -> Any:
    """TRL's report_to: "none", "all", one name or a list; preftune's: a list of trackers."""
    if value in ("none", None):
        return []
    return [value] if isinstance(value, str) else value


def _resume(value: Any) -> Any:
    """TRL's resume_from_checkpoint: True (the newest checkpoint), None/False (start over), or a
    path."""
    return (
        {True: "auto", False: "never", None: "never"}.get(value, value)
        if not isinstance(value, str)
        else value
    )


def _scale_rewards(value: Any) -> Any:
    """TRL 1.16 reads True as "group" and False as "none" (the bools of TRL < 0.22)."""
    return {True: "group", False: "none"}.get(value, value) if isinstance(value, bool) else value


# preftune key -> the change that turns TRL's value into preftune's (also under preftune's own name)
TRL_VALUES: dict[str, Callable[[Any], Any]] = {
    "log.report_to": _report_to, "resume": _resume, "grpo.scale_rewards": _scale_rewards}

# TRL name -> (preftune key, the change of value, what it means here)
CONVERTED: dict[str, tuple[str, Callable[[Any], Any], str]] = {
    "bf16": ("model.dtype", lambda v: "bfloat16" if v else "float32",
             "true: bfloat16, false: float32"),
    "disable_tqdm": ("log.progress_bar", lambda v: not v if isinstance(v, bool) else v, "inverted"),
}

# TRL name -> (preftune key, how preftune's key differs); `{algorithm}` is the run's section
DIFFERENT: dict[str, tuple[str, str]] = {
    "per_device_train_batch_size": (
        "{algorithm}.micro_batch_size",
        "rows per forward/backward; the optimiser step's size is global (grpo.prompts_per_step, "
        "dpo/kto/sft.batch_size) and gradient accumulation follows from it"),
    "gradient_accumulation_steps": (
        "{algorithm}.batch_size",
        "preftune sizes the step globally (all processes "
        "together) and accumulates micro-batches itself"),
    "generation_batch_size": (
        "grpo.prompts_per_step",
        "preftune counts prompts: generation_batch_size / num_generations"),
    "steps_per_generation": (
        "grpo.prompts_per_step", "preftune takes one optimiser step per generation batch "
        "(grpo.num_iterations repeats it)"),
    "num_train_epochs": ("max_steps", "preftune counts optimiser steps, not epochs"),
    "per_device_eval_batch_size": ("eval.batch_size",
                                   "prompts per evaluation batch on each process"),
    "model_init_kwargs": ("model.dtype",
                          "preftune reads dtype and trust_remote_code as model.dtype and "
                          "model.trust_remote_code"),
    "peft_config": ("model.lora.enabled",
                    "a LoRA is configured under model.lora (r, alpha, dropout, target_modules)"),
    "eval_strategy": ("eval.eval_steps",
                      "preftune evaluates every eval.eval_steps steps (0: before and after)"),
    "save_strategy": ("save_steps",
                      "preftune saves every save_steps steps (0: only on preemption)"),
}


def _peers() -> tuple[dict[str, list[str]], dict[str, str]]:
    """({TRL name: the keys that mean it}, {old TRL name: key}) from the declarations' peers."""
    aliases: dict[str, list[str]] = {}
    old: dict[str, str] = {}
    for key, f, _ in keys(Config):
        for part in (f.metadata.get("peer") or "").split(";"):
            m = _PLAIN.fullmatch(part.strip())
            if m:
                aliases.setdefault(m[1], []).append(key)
                if m[2]:
                    old[m[2]] = key
    return aliases, old


ALIASES, OLD_NAMES = _peers()


def _pick(candidates: list[str], algorithm: str) -> str | None:
    """The key a flat TRL name means: the only one, or the one in the algorithm's section."""
    if len(candidates) == 1:
        return candidates[0]
    return next((k for k in candidates if k.startswith(f"{algorithm}.")), None)


def _format(key: str, algorithm: str) -> str:
    """A DIFFERENT key for the run's algorithm (GRPO sizes its step in prompts, not a
    batch_size)."""
    key = key.format(algorithm=algorithm)
    return "grpo.prompts_per_step" if key == "grpo.batch_size" else key


def trl_key(name: str, algorithm: str = "grpo") -> str | None:
    """The preftune key a TRL name is, or points to (for a hint); None if the table has no such
    name."""
    if name in OLD_NAMES:
        return OLD_NAMES[name]
    if name in ALIASES:
        return _pick(ALIASES[name], algorithm)
    if name in CONVERTED:
        return CONVERTED[name][0]
    if name in DIFFERENT:
        return _format(DIFFERENT[name][0], algorithm)
    return None


def _unknown(data: dict) -> list[tuple[str, dict, str]]:
    """(dotted key, the mapping that holds it, its name) of every key, at the top level or in a
    section, that the schema does not declare."""
    top = {f.name: f for f in dataclasses.fields(Config) if not f.metadata.get("internal")}
    declared = {k for k, _, _ in keys(Config)}
    found = []
    for name in list(data):
        if name not in top:
            found.append((str(name), data, str(name)))
        elif top[name].metadata.get("section") and isinstance(data[name], dict):
            found += [(f"{name}.{sub}", data[name], str(sub)) for sub in list(data[name])
                      if f"{name}.{sub}" not in declared and not isinstance(data[name][sub], dict)]
    return found


def _set(data: dict, key: str, value: Any, given_as: str) -> None:
    """Place `value` at dotted `key`; a different value already there is an error naming both."""
    node = data
    *sections, last = key.split(".")
    for part in sections:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise UserError(f"'{part}' is not a section", where=given_as)
    if last in node and node[last] != value:
        raise UserError(f"is TRL's name for '{key}', which is "
                        f"also set (to {node[last]!r}): keep one",
                        where=given_as)
    node[last] = value


def translate(data: dict) -> dict:
    """`data` (a nested config dict) with TRL's names and values made preftune's, in place; a TRL
    name that preftune means differently is a UserError naming the exact key."""
    algorithm = data.get("algorithm", "grpo")
    algorithm = algorithm if algorithm in ALGORITHMS else "grpo"
    for dotted, holder, name in _unknown(data):
        section = dotted.split(".")[0] if "." in dotted else None
        run_as = section if section in ALGORITHMS else algorithm
        if name in ALIASES and name not in OLD_NAMES:
            key = _pick(ALIASES[name], run_as)
            if key is None:
                raise UserError(f"unknown config key '{dotted}': TRL's {name} is "
                                f"{' / '.join(ALIASES[name])}, none of them {run_as}'s")
            _set(data, key, holder.pop(name), dotted)
        elif name in CONVERTED:
            key, change, _ = CONVERTED[name]
            _set(data, key, change(holder.pop(name)), dotted)
        elif name in OLD_NAMES:
            raise UserError(f"unknown config key '{dotted}' (TRL's old "
                            f"name); preftune calls it '{OLD_NAMES[name]}'")
        elif name in DIFFERENT:
            key, how = DIFFERENT[name]
            key = _format(key, run_as)
            raise UserError(f"unknown config key '{dotted}': TRL's {name} is not preftune's; the "
                            f"nearest is '{key}' ({how})")
    for key, change in TRL_VALUES.items():
        node = data
        *sections, last = key.split(".")
        for part in sections:
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, dict) and last in node:
            node[last] = change(node[last])
    return data


def rows() -> list[tuple[str, str, str]]:
    """(TRL name, preftune key, how) for every TRL name the table knows that preftune spells
    differently or places in a section: docs/from-trl.md's table."""
    out = [(n, " / ".join(ks), "accepted (the same meaning)") for n, ks in sorted(ALIASES.items())
           if n not in OLD_NAMES and ks != [n]]
    out += [(n, k, f"accepted: {how}") for n, (k, _, how) in sorted(CONVERTED.items())]
    out += [(n, k, "TRL's old name: answered with the key") for n, k in sorted(OLD_NAMES.items())]
    out += [(n, k, f"answered with the key: {how}") for n, (k, how) in sorted(DIFFERENT.items())]
    return out
