"""Prompt and response tokenisation shared by every algorithm (one rule for train, eval and
rollout)."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from preftune.data.messages import is_messages
from preftune.errors import UserError

log = logging.getLogger("preftune")


def prompt_text(tokenizer, prompt, tools: list[dict] | None = None) -> str:
    """A chat prompt goes through the tokenizer's chat template (with the `tools` JSON schemas the
    policy may call, when given); a string is used as is."""
    if is_messages(prompt):
        if not getattr(tokenizer, "chat_template", None):
            raise UserError("prompts are chat messages but the tokenizer has no chat_template",
                            where="model")
        extra = {"tools": tools} if tools else {}
        return tokenizer.apply_chat_template(prompt, tokenize=False,
                                             add_generation_prompt=True, **extra)
    return str(prompt)


def response_text(response) -> str:
    """A response given as messages is the content of its assistant turn(s)."""
    if is_messages(response):
        return "".join(str(m.get("content", "")) for m in response if m.get("role") == "assistant")
    return str(response)


@dataclass
class PromptTruncation:
    """Policy for prompts over max_prompt_length: keep the last tokens (left), drop, or error."""

    max_length: int
    policy: str = "left"
    truncated: int = 0
    dropped: int = 0
    seen: set = field(default_factory=set)

    def drop_empty(self, where: str) -> None:
        """A prompt that renders to no token at all (nothing to sample from): dropped, counted
        once."""
        if where not in self.seen:
            self.seen.add(where)
            self.dropped += 1
            log.warning("%s renders to 0 tokens: dropped (counted in prompts_dropped)", where)

    def apply(self, ids: list[int], where: str) -> list[int] | None:
        if len(ids) <= self.max_length:
            return ids
        if self.policy == "error":
            raise UserError(f"prompt has {len(ids)} tokens > "
                            f"data.max_prompt_length={self.max_length}", where=where)
        first = where not in self.seen  # count each prompt once even when it is drawn again
        self.seen.add(where)
        if self.policy == "drop":
            self.dropped += first
            return None
        self.truncated += first
        return ids[-self.max_length:]


def fit_prompt(truncation: PromptTruncation, ids: list[int], max_length: int,
               where: str) -> list[int] | None:
    """A prompt under the data.max_prompt_length policy, then cut from the left so that at least one
    response token fits in `max_length` (prompt + response); None when the policy drops it."""
    ids = truncation.apply(ids, where)
    if ids is not None and len(ids) >= max_length:
        ids, truncation.truncated = ids[-(max_length - 1):], truncation.truncated + 1
    return ids


def encode_prompt(tokenizer, prompt, tools: list[dict] | None = None) -> list[int]:
    text = prompt_text(tokenizer, prompt, tools)
    return tokenizer(text, add_special_tokens=not is_messages(prompt)).input_ids


def encode_response(tokenizer, response, *, add_eos: bool = True) -> list[int]:
    ids = tokenizer(response_text(response), add_special_tokens=False).input_ids
    if add_eos and tokenizer.eos_token_id is not None:
        ids = ids + [tokenizer.eos_token_id]
    return ids
