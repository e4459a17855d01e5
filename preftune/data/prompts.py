"""Prompt sets for online GRPO and evaluation: a prompt column plus any other columns (e.g.
`answer`).

The other columns are carried as python lists so reward functions can receive them per prompt.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from preftune.data.traces import (
    display_path,
    normalize_messages,
    read_rows,
    resolve_files,
    text_problem,
)
from preftune.errors import UserError

FALLBACK_PROMPT_COLUMN = "prompt"  # TRL / HF datasets name; used when the default column is absent


@dataclass
class PromptSet:
    prompts: list  # str or chat messages
    # every other column, one value per prompt
    columns: dict[str, list] = field(default_factory=dict)
    files: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.prompts)

    def select(self, indices: Sequence[int]) -> tuple[list, dict[str, list]]:
        """(prompts, columns) of the given rows, in the given order."""
        return ([self.prompts[i] for i in indices],
                {name: [values[i] for i in indices] for name, values in self.columns.items()})


def _prompt_column(columns: list[str], wanted: str, default: str, where: str) -> str:
    if wanted in columns:
        return wanted
    # Only the default falls back: a column the user named explicitly must exist.
    if wanted == default and FALLBACK_PROMPT_COLUMN in columns:
        return FALLBACK_PROMPT_COLUMN
    also = f" (or {FALLBACK_PROMPT_COLUMN!r})" if wanted == default else ""
    raise UserError(f"missing prompt column {wanted!r}{also}; columns present: "
                    f"{', '.join(columns) or '(none)'}",
                    where=where)


def load_prompts(path: str, *, prompt_column: str = "input") -> PromptSet:
    """Read a prompt set (parquet / jsonl / csv; file, folder, glob or URL).

    Column `prompt_column` (default "input"; "prompt" when "input" is absent) holds the prompts;
    a column missing from some files is filled with None there.
    """
    fs, files = resolve_files(path)
    prompts: list = []
    columns: dict[str, list] = {}
    for fpath in files:
        where = display_path(fs, fpath)
        # CSV values stay text: an answer such as "007" or "1.50" must reach reward functions as
        # written.
        rows, names = read_rows(fs, fpath, text_columns=None)
        if names is None:  # empty JSON file
            continue
        column = _prompt_column(names, prompt_column, "input", where)
        for name in names:
            if name != column and name not in columns:
                columns[name] = [None] * len(prompts)  # new column: earlier files lacked it
        for i, row in enumerate(rows):
            value = row.get(column)
            problem = text_problem(value, "prompt")
            if problem:
                raise UserError(problem[1], where=f"{where} row {i} column {column}")
            prompts.append(normalize_messages(value) if isinstance(value, list) else value)
            for name, values in columns.items():
                values.append(row.get(name))
    if not prompts:
        raise UserError("no prompts found (the files have no rows)", where=path)
    return PromptSet(prompts, columns, [display_path(fs, f) for f in files])
