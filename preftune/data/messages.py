"""Chat messages: the one rule for "this value is a conversation" (data, tokenisation, rewards)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_messages(value: Any) -> bool:
    """A chat conversation: a non-empty list of mappings, each with a string `role` and a `content`
    (an assistant turn that only calls tools may have `tool_calls` instead).

    `content` may be a string or a list of typed blocks (multimodal); data validation additionally
    requires strings (`data.traces.text_problem`).
    """
    return (
        isinstance(value, (list, tuple))
        and len(value) > 0
        and all(
            isinstance(m, Mapping)
            and isinstance(m.get("role"), str)
            and ("content" in m or "tool_calls" in m)
            for m in value
        )
    )
