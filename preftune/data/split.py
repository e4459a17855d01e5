"""A deterministic held-out split by prompt (`eval.split`): the same prompts are held out from
training and used for evaluation, whatever the file order, the seed or the machine.

A prompt is held out when the first 8 bytes of sha256(canonical prompt) read as a fraction in
[0, 1) fall below `fraction`; all responses of a held-out prompt leave training together, so no
held-out prompt is ever trained on.
"""
from __future__ import annotations

import hashlib
from typing import Any

from preftune.data.prompts import PromptSet
from preftune.data.traces import normalize_messages, prompt_key


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

