"""A deterministic held-out split by prompt (`eval.split`): the same prompts are held out from
training and used for evaluation, whatever the file order, the seed or the machine.

A prompt is held out when the first 8 bytes of sha256(canonical prompt) read as a fraction in
[0, 1) fall below `fraction`; all responses of a held-out prompt leave training together, so no
held-out prompt is ever trained on.
"""
from __future__ import annotations

import hashlib
from typing import Any

from preftune.data.prompts import PromptSet, load_prompts
from preftune.data.sft import TRACES, detect_format, load_examples
from preftune.data.traces import load_traces, normalize_messages, prompt_key, read_rows, resolve_files
from preftune.errors import UserError


def prompt_fraction(prompt: Any) -> float:
    key = prompt_key(normalize_messages(prompt) if isinstance(prompt, list) else prompt)
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2 ** 64


def is_held_out(prompt: Any, fraction: float) -> bool:
    return fraction > 0 and prompt_fraction(prompt) < fraction


def drop_held_out(items: list, fraction: float, prompt_of=lambda x: x.prompt) -> tuple[list, int]:
    """(items whose prompt is not held out, how many were held out)."""
    if fraction <= 0:
        return items, 0
    kept = [x for x in items if not is_held_out(prompt_of(x), fraction)]
    return kept, len(items) - len(kept)


def split_prompt_set(prompt_set, fraction: float, *, held_out: bool):
    """The held-out part (held_out=True) or the training part of a PromptSet."""
    rows = [i for i, p in enumerate(prompt_set.prompts) if is_held_out(p, fraction) == held_out]
    prompts, columns = prompt_set.select(rows)
    return PromptSet(prompts, columns, prompt_set.files)


def held_out_prompts(path: str, fraction: float, opts):
    """The held-out prompts of a training set: a prompt file's rows, or the distinct prompts of traces,
    prompt/completion or messages files (with the other columns of each prompt's first row)."""
    fmt = detect_format(path)
    cols = _columns(path)
    if fmt == TRACES and opts.response_column in cols and opts.reward_column in cols:
        traces, _ = load_traces(path, opts)
        rows = [(t.prompt, t.extra) for t in traces]
    elif fmt == TRACES:
        ps = split_prompt_set(load_prompts(path, prompt_column=opts.prompt_column), fraction, held_out=True)
        if not len(ps):
            raise UserError(f"eval.split={fraction} holds out no prompt of {len(ps)}", where=path)
        return ps
    else:
        examples, _ = load_examples(path, opts, min_reward=float("-inf"))
        rows = [(e.prompt, {}) for e in examples]
    seen, prompts, extras = set(), [], []
    for prompt, extra in rows:
        key = prompt_key(prompt)
        if key not in seen and is_held_out(prompt, fraction):
            seen.add(key)
            prompts.append(prompt)
            extras.append(extra)
    if not prompts:
        raise UserError(f"eval.split={fraction} holds out no prompt", where=path)
    names = list(dict.fromkeys(k for e in extras for k in e))
    return PromptSet(prompts, {k: [e.get(k) for e in extras] for k in names}, [path])


def _columns(path: str) -> list[str]:
    fs, files = resolve_files(path)
    return next((c for c in (read_rows(fs, f)[1] for f in files) if c), None) or []
