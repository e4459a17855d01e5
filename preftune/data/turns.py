"""Agent conversations as token ids with a per-token loss mask: the one encoder every algorithm
uses for a (prompt, response) row (SFT, DPO, KTO, offline GRPO).

A plain response (a string, or one assistant message without tool calls) and no tools: the
prompt through the chat template, the response text + EOS, every response token counted (mask
None), exactly as before agent traces existed.

A multi-turn response (assistant -> tool -> assistant ..., or tool calls) or tools: the whole
conversation goes through the chat template with `tools=`. Where each turn starts and ends is
found by rendering prefixes: the conversation up to turn i (with the generation prompt when turn
i is the assistant's) and up to turn i + 1. Each render must be a text prefix of the next, else
the template rewrites history (e.g. drops earlier reasoning) and the row stops with a UserError
naming the template. Each piece between two renders is tokenised on its own and the pieces are
concatenated, so the ids never depend on a merge across a turn boundary (as a sampler that
appends a tool result to its own tokens sees them). An assistant piece is counted (mask 1) up to
and including its last EOS token (the turn's stop token stays in the loss); what the template
puts after it (a newline), the assistant header of a later turn, and tool, user and system
turns are masked (0).
"""
from __future__ import annotations

from dataclasses import dataclass

from preftune.data.messages import is_messages
from preftune.data.tokenize import PromptTruncation, encode_prompt, encode_response, fit_prompt
from preftune.data.tools import default_tools
from preftune.errors import UserError, one_line


@dataclass
class Encoded:
    """A row's prompt ids, completion ids and the completion's loss mask (None: every token
    counts)."""

    prompt: list[int]
    completion: list[int]
    mask: list[int] | None = None

    def cut(self, room: int) -> "Encoded":
        """The completion (and its mask) cut to `room` tokens."""
        return Encoded(self.prompt, self.completion[:room],
                       None if self.mask is None else self.mask[:room])


def is_multi_turn(response) -> bool:
    """A response that only the chat template can lay out: more than one turn, a non-assistant turn
    or a tool call."""
    return is_messages(response) and (len(response) > 1 or response[0].get("role") != "assistant"
                                      or bool(response[0].get("tool_calls")))


def encode_row(tokenizer, prompt, response, *, tools: list[dict] | None = None,
               assistant_only: bool = True, where: str = "") -> Encoded:
    """(prompt ids, completion ids, mask) of one row: the plain path when the row has no tools and
    a plain response, else the conversation through the template (`assistant_only` False: every
    completion token counts, tool and user turns included)."""
    if not tools and not is_multi_turn(response):
        return Encoded(encode_prompt(tokenizer, prompt), encode_response(tokenizer, response))
    prompt_msgs = list(prompt) if is_messages(prompt) else [{"role": "user",
                                                             "content": str(prompt)}]
    response_msgs = list(response) if is_messages(response) else [{"role": "assistant",
                                                                   "content": str(response)}]
    enc = conversation_ids(tokenizer, prompt_msgs, response_msgs, tools, where=where)
    return Encoded(enc.prompt, enc.completion, None if not assistant_only else enc.mask)


def encode_fitted(tokenizer, truncation: PromptTruncation, prompt,
                  responses: list, *, max_length: int,
                  tools: list[dict] | None = None, assistant_only: bool = True,
                  where: str = "") -> tuple[list[int], list[Encoded], int] | None:
    """A prompt and its responses (one for SFT and KTO, chosen and rejected for DPO) encoded
    (`encode_row`): the prompt under data.max_prompt_length's policy (None when it drops it), each
    response and its mask cut so that prompt + response fit `max_length` -> (prompt ids, encoded
    responses, how many were cut)."""
    rows = [encode_row(tokenizer, prompt, r, tools=tools,
                       assistant_only=assistant_only, where=where)
            for r in responses]
    ids = fit_prompt(truncation, rows[0].prompt, max_length, where=where)
    if ids is None:
        return None
    room = max_length - len(ids)
    return ids, [r.cut(room) for r in rows], sum(len(r.completion) > room for r in rows)


def encode_set(tokenizer, rows, *, truncation: PromptTruncation, max_length: int,
               tools_file: str | None, model: str, assistant_only: bool = True,
               label: str = "example") -> tuple[list[tuple[int, list[int], list[Encoded]]], dict]:
    """Every row of a set, `(prompt, responses, the row's tools or None)`, encoded by
    `encode_fitted` (DPO's pairs, KTO's and SFT's examples), with the set's tools (`data.tools`)
    where a row has none, the template's tool support checked once -> (kept: (row index, prompt
    ids, encoded responses), the counts: prompts_truncated, prompts_dropped, completions_truncated:
    responses cut to fit)."""
    rows = list(rows)
    tools = default_tools(tokenizer, tools_file, model, (own for _, _, own in rows))
    kept, cut = [], 0
    for i, (prompt, responses, own) in enumerate(rows):
        enc = encode_fitted(tokenizer, truncation, prompt, responses, max_length=max_length,
                            tools=own or tools, assistant_only=assistant_only,
                            where=f"{label} {i}")
        if enc is not None:
            cut += enc[2]
            kept.append((i, enc[0], enc[1]))
    return kept, {"prompts_truncated": truncation.truncated, "prompts_dropped": truncation.dropped,
                  "completions_truncated": cut}


def _render(tokenizer, messages: list[dict], tools, generation: bool, where: str) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation,
                                             **({"tools": tools} if tools else {}))
    except Exception as e:  # noqa: BLE001 - a template's own error (jinja raise_exception) names no row
        raise UserError(f"the chat template of {_name(tokenizer)} "
                        f"cannot render this conversation: {one_line(e)}",
                        where=where) from None


def _name(tokenizer) -> str:
    return getattr(tokenizer, "name_or_path", "") or "the model"


def _pieces(tokenizer, prompt: list[dict], response: list[dict], tools,
            where: str) -> tuple[str, list]:
    """The prompt's render and, after it, each render of a longer prefix with whether its new
    text is an assistant turn's."""
    msgs, n0 = prompt + response, len(prompt)
    head = _render(tokenizer, prompt, tools, response[0]["role"] == "assistant", where)
    out = []
    for i in range(n0, len(msgs)):
        assistant = msgs[i]["role"] == "assistant"
        # the header of a later assistant turn: the template's, not the model's
        if assistant and i > n0:
            out.append((_render(tokenizer, msgs[:i], tools, True, where), False))
        out.append((_render(tokenizer, msgs[:i + 1], tools, False, where), assistant))
    return head, out


def conversation_ids(tokenizer, prompt: list[dict], response: list[dict],
                     tools: list[dict] | None = None, *, where: str = "") -> Encoded:
    """The conversation's ids, split after the prompt's render, with the completion's mask: 1 on
    each assistant turn up to and including its last EOS, 0 elsewhere."""
    head, pieces = _pieces(tokenizer, prompt, response, tools, where)
    prompt_ids = tokenizer(head, add_special_tokens=False).input_ids
    eos = tokenizer.eos_token_id
    ids, mask, prev = [], [], head
    for text, assistant in pieces:
        if not text.startswith(prev):
            raise UserError(f"the chat template of {_name(tokenizer)} rewrites earlier turns when "
                            "a turn is added (a render of the conversation's first turns is not a "
                            "prefix of the next render), so the assistant turns cannot be "
                            "located; use a template that keeps history as it is",
                            where=where)
        piece = tokenizer(text[len(prev):], add_special_tokens=False).input_ids
        keep = [0] * len(piece)
        if assistant:
            end = max((k + 1 for k, t in enumerate(piece) if t == eos), default=len(piece))
            # the turn's stop token counts; what follows it is the template's
            keep[:end] = [1] * end
        ids += piece
        mask += keep
        prev = text
    return Encoded(prompt_ids, ids, mask)
