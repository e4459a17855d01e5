"""SFT examples (prompt, completion) from the three layouts a pipeline or TRL user has at hand.

- labeled traces (`input`, `output`, `final_reward`): the responses with reward >= `sft.min_reward`
  (rejection-sampling fine-tuning); every other row is counted as `below_min_reward`;
- TRL's prompt-completion format: `prompt` and `completion` columns (strings or chat messages);
- TRL's conversational format: a `messages` column; the turns before the first assistant turn are
  the prompt, the rest (ending with an assistant turn) the completion: every assistant turn trains,
  the user and tool turns between them are masked (`data/turns.py`, `sft.assistant_only_loss`).

Each layout may carry a `tools` column (JSON function schemas, `data/tools.py`) rendered into the
prompt by the chat template.

Rows are validated as traces are (`data.invalid`, `data.duplicates`), and every row left out is
counted by reason: nothing is dropped silently. `data/pipeline.load_examples` reads all three.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from preftune.data.tools import TOOLS_COLUMN, parse_tools
from preftune.data.traces import (DropReport, TraceOptions, display_path,
                                  is_messages, normalize_messages,
                                  prompt_key, read_rows, require_columns,
                                  resolve_files, text_problem)
from preftune.errors import UserError

MESSAGES, PROMPT_COMPLETION, TRACES = "messages", "prompt_completion", "traces"


@dataclass
class Example:
    prompt: Any  # str or chat messages (rendered with the chat template)
    completion: Any  # str or messages from the first assistant turn on (the last an assistant turn)
    tools: list[dict] | None = None  # tool schemas rendered into the prompt (`data/tools.py`)


def detect_format(path: str) -> str:
    """`messages` or `prompt_completion` when the first non-empty file has those columns, else
    traces."""
    fs, files = resolve_files(path)
    columns = next((c for c in (read_rows(fs, f)[1] for f in files) if c), None) or []
    if MESSAGES in columns:
        return MESSAGES
    if {"prompt", "completion"} <= set(columns):
        return PROMPT_COMPLETION
    return TRACES



def _split_messages(value: Any) -> tuple[tuple[str, str] | None, Example | None]:
    """A conversation -> Example(turns before the first assistant turn, the rest) or a (reason,
    message) problem."""
    if not is_messages(value):
        return text_problem(value, "messages") or ("bad_messages_type",
                                                   "messages is not a chat message list"), None
    msgs = normalize_messages(value)
    first = next((i for i, m in enumerate(msgs) if m["role"] == "assistant"), 0)
    if first < 1 or msgs[-1]["role"] != "assistant":
        return ("bad_messages",
                "messages need at least one prompt turn and must end with an assistant turn"), None
    if not msgs[-1].get("content", "").strip() and not msgs[-1].get("tool_calls"):
        return ("empty_completion", "the last assistant turn is empty"), None
    return None, Example(msgs[:first], msgs[first:])


def _row_example(row: dict, fmt: str) -> tuple[tuple[str, str, str] | None, Example | None]:
    if fmt == MESSAGES:
        problem, ex = _split_messages(row.get(MESSAGES))
        return (problem[0], MESSAGES, problem[1]) if problem else None, ex
    for column in ("prompt", "completion"):
        problem = text_problem(row.get(column), column)
        if problem:
            return (problem[0], column, problem[1]), None
    p, c = row["prompt"], row["completion"]
    return None, Example(normalize_messages(p) if isinstance(p, list) else p,
                         normalize_messages(c) if isinstance(c, list) else c)


def _with_tools(ex: Example, row: dict, where: str) -> Example:
    if row.get(TOOLS_COLUMN) is not None:
        ex.tools = parse_tools(row[TOOLS_COLUMN], where=f"{where} column {TOOLS_COLUMN}")
    return ex


def read_trl(path: str, fmt: str, opts: TraceOptions) -> tuple[list[Example], DropReport]:
    fs, files = resolve_files(path)
    report = DropReport(files=len(files))
    out: list[Example] = []
    seen: dict[tuple, str] = {}
    needed = (MESSAGES,) if fmt == MESSAGES else ("prompt", "completion")
    for fpath in files:
        where = display_path(fs, fpath)
        rows, columns = read_rows(fs, fpath, text_columns=needed)
        require_columns(columns, needed, where)
        for i, row in enumerate(rows):
            report.total_rows += 1
            problem, ex = _row_example(row, fmt)
            if problem:
                if opts.invalid == "error":
                    raise UserError(problem[2], where=f"{where} row {i} column {problem[1]}")
                report.dropped[problem[0]] += 1
                continue
            ex = _with_tools(ex, row, f"{where} row {i}")
            key = (prompt_key(ex.prompt), prompt_key(ex.completion))
            if opts.duplicates != "keep" and key in seen:
                if opts.duplicates == "error":
                    raise UserError(f"exact duplicate of {seen[key]} "
                                    "(set data.duplicates: drop or keep)",
                                    where=f"{where} row {i}")
                report.dropped["duplicate"] += 1
                continue
            seen.setdefault(key, f"{where} row {i}")
            out.append(ex)
    report.kept = len(out)
    return out, report
