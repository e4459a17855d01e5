"""Built-in reward functions with TRL's reward contract.

Every reward is called as `f(prompts, completions, completion_ids, **columns)` and returns one
`float | None` per completion (`None` = not applicable to that row). A completion is either a
string or, for chat data, a list of messages `[{"role": "assistant", "content": text}]`.

`BUILTINS` maps a name to a factory `factory(options) -> reward function`; the returned function's
`__name__` is the builtin name, so metrics read `rewards/<name>/mean`. Options a builtin does not
use are ignored.
"""
from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from preftune.errors import UserError

# ---------------------------------------------------------------------------------------------
# helpers


def completion_text(completion: Any) -> str:
    """The text to score: the string itself, or for chat completions the content of the last
    assistant message (where a tool-using turn puts its final answer)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, Mapping):
        return _content_text(completion.get("content"))
    if isinstance(completion, (list, tuple)) and completion:
        assistant = [m for m in completion if isinstance(m,
                                                         Mapping) and m.get("role") == "assistant"]
        last = assistant[-1] if assistant else completion[-1]
        return _content_text(last.get("content") if isinstance(last, Mapping) else last)
    return "" if completion is None else str(completion)


def _content_text(content: Any) -> str:
    # Multimodal messages carry a list of blocks: [{"type": "text", "text": ...}, {"type":
    # "image"}].
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, (list, tuple)):
        parts = [
            b.get("text", "")
            for b in content
            if isinstance(b, Mapping) and b.get("type", "text") == "text"
        ]
        return "".join(parts)
    return str(content)


_ANSWER_RE = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)


def extract_answer(text: str) -> str:
    """Content of the last `<answer>...</answer>` block, or the whole text when there is none.
    The last block wins because models often restate a corrected answer at the end."""
    blocks = _ANSWER_RE.findall(text)
    return (blocks[-1] if blocks else text).strip()


def _as_number(text: str) -> float | None:
    try:
        value = float(text)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def answers_match(predicted: str, reference: Any) -> bool:
    """True when both strip to equal numbers ("19" == "19.0"), else when the strings are equal."""
    pred, ref = predicted.strip(), str(reference).strip()
    pred_num, ref_num = _as_number(pred), _as_number(ref)
    if pred_num is not None and ref_num is not None:
        return math.isclose(pred_num, ref_num, rel_tol=1e-9, abs_tol=0.0)
    return pred == ref


def _require_int(options: Mapping[str, Any], key: str, builtin: str, *, minimum: int) -> int:
    value = options.get(key)
    if value is None:
        raise UserError(f"the `{builtin}` reward needs the `{key}` option",
                        where=f"reward '{builtin}'")
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UserError(f"`{key}` must be an integer >= {minimum}, got {value!r}",
                        where=f"reward '{builtin}'")
    return value


# ---------------------------------------------------------------------------------------------
# rewards


def accuracy(prompts, completions, completion_ids=None, answer=None,
             **kwargs) -> list[float | None]:
    """1.0 when the completion's answer equals the row's `answer` column, else 0.0.

    The answer is the content of the completion's last `<answer>...</answer>` block, or the whole
    completion when it has none; both sides are stripped. If both parse as finite numbers they are
    compared numerically ("19" == "19.0"), otherwise as exact strings. A row whose `answer` is None
    scores None (not applicable).
    """
    if answer is None:
        raise UserError("the `accuracy` reward needs an `answer` column in the dataset",
                        where="reward 'accuracy'")
    rewards: list[float | None] = []
    for completion, ref in zip(completions, answer, strict=True):
        if ref is None:
            rewards.append(None)
            continue
        predicted = extract_answer(completion_text(completion))
        rewards.append(1.0 if answers_match(predicted, ref) else 0.0)
    return rewards


# <think>reasoning</think> then <answer>final</answer> and nothing else (DeepSeek-R1,
# arXiv:2501.12948). Tag bodies may not contain another tag, so doubled or nested blocks fail.
_NO_TAG = r"(?:(?!</?(?:think|answer)>).)*"
_FORMAT_RE = re.compile(rf"<think>{_NO_TAG}</think>\s*<answer>{_NO_TAG}</answer>", re.DOTALL)


def format(prompts, completions, completion_ids=None,
           **kwargs) -> list[float]:  # noqa: A001 (builtin name)
    """1.0 when the completion, stripped, is exactly `<think>...</think>` followed (after optional
    whitespace) by `<answer>...</answer>` -- the DeepSeek-R1 reasoning format -- else 0.0."""
    return [1.0 if _FORMAT_RE.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]


def soft_overlong_penalty(length: int, max_completion_length: int,
                          overlong_buffer_len: int) -> float:
    """DAPO soft overlong punishment (arXiv:2503.14476, eq. 13), L_max = max_completion_length,
    L_cache = overlong_buffer_len:

        r = 0                                  if |y| <= L_max - L_cache
        r = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
        r = -1                                 if |y| > L_max
    """
    free = max_completion_length - overlong_buffer_len
    if length <= free:
        return 0.0
    if length <= max_completion_length:
        return (free - length) / overlong_buffer_len  # L_cache > 0 here: the interval is non-empty
    return -1.0


class _SoftOverlong:
    """DAPO soft overlong punishment on each completion's token length (`soft_overlong_penalty`):
    0 inside the budget, a linear ramp to -1 over the last `overlong_buffer_len` tokens, -1 past
    `max_completion_length`."""

    # A callable object (not a closure) so the configured reward stays picklable.
    __name__ = "soft_overlong"

    def __init__(self, max_completion_length: int, overlong_buffer_len: int):
        self.max_completion_length = max_completion_length
        self.overlong_buffer_len = overlong_buffer_len

    def __call__(self, prompts, completions, completion_ids, **kwargs) -> list[float]:
        return [
            soft_overlong_penalty(len(ids), self.max_completion_length, self.overlong_buffer_len)
            for ids in completion_ids
        ]


def length_penalty(length: int, max_completion_length: int,
                   target_length: int | None = None) -> float:
    """Length reward in [-1, 0]: r = -min(|y|, L_max) / L_max, or with a target length L_t,
    r = -min(| |y| - L_t |, L_max) / L_max (0 exactly at the target)."""
    distance = length if target_length is None else abs(length - target_length)
    return -min(distance, max_completion_length) / max_completion_length


class _Length:
    """Token-length reward (`length_penalty`): -|y|/L_max, or -| |y| - length_target |/L_max when
    the `length_target` option is set; clipped to [-1, 0]."""

    # A callable object (not a closure) so the configured reward stays picklable.
    __name__ = "length"

    def __init__(self, max_completion_length: int, target_length: int | None):
        self.max_completion_length = max_completion_length
        self.target_length = target_length

    def __call__(self, prompts, completions, completion_ids, **kwargs) -> list[float]:
        return [
            length_penalty(len(ids), self.max_completion_length, self.target_length)
            for ids in completion_ids
        ]


# ---------------------------------------------------------------------------------------------
# factories


def _make_soft_overlong(options: Mapping[str, Any]) -> Callable:
    max_len = _require_int(options, "max_completion_length", "soft_overlong", minimum=1)
    buffer = _require_int(options, "overlong_buffer_len", "soft_overlong", minimum=0)
    if buffer > max_len:
        raise UserError(
            f"`overlong_buffer_len` ({buffer}) must be <= `max_completion_length` ({max_len})",
            where="reward 'soft_overlong'",
        )
    return _SoftOverlong(max_len, buffer)


def _make_length(options: Mapping[str, Any]) -> Callable:
    max_len = _require_int(options, "max_completion_length", "length", minimum=1)
    target = None
    if options.get("length_target") is not None:
        target = _require_int(options, "length_target", "length", minimum=0)
    return _Length(max_len, target)


BUILTINS: dict[str, Callable[[Mapping[str, Any]], Callable]] = {
    "accuracy": lambda options: accuracy,
    "format": lambda options: format,
    "soft_overlong": _make_soft_overlong,
    "length": _make_length,
}
