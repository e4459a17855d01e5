"""DPO preference pairs from labeled traces, and the pairs file (TRL's prompt/chosen/rejected
format).

A response is *chosen* when reward >= chosen_min and *rejected* when reward < rejected_max; a pair
joins a chosen and a rejected response to the same prompt (Rafailov et al. 2023, "Direct
Preference Optimization", needs exactly such (x, y_w, y_l) triples).

Tie rule (deterministic): among equal rewards or equal margins, the response that comes first in
the dataset wins, i.e. the lower (file, row) position in load order.
"""
from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from preftune.atomic import atomic_path
from preftune.config import CHOICES, DataConfig
from preftune.data.tools import TOOLS_COLUMN, parse_tools
from preftune.data.traces import (
    Trace, display_path, is_local, normalize_messages, prompt_key, read_rows,
    require_columns, resolve_files, reward_problem, text_problem)
from preftune.errors import UserError

if TYPE_CHECKING:  # annotations only; arrow is imported where a file is read or written
    import pyarrow as pa

STRATEGIES = CHOICES["data.pair_strategy"]
_DATA = DataConfig()  # the pairing defaults; the config dataclass is their one home
# build_pairs' keyword arguments -> the DataConfig fields that set them
_PAIR_FIELDS = {"chosen_min": "chosen_min", "rejected_max": "rejected_max",
                "strategy": "pair_strategy",
                "max_pairs_per_prompt": "max_pairs_per_prompt", "min_margin": "min_margin"}


def pair_options(d: DataConfig) -> dict:
    """build_pairs' keyword arguments from a config's data section."""
    return {arg: getattr(d, name) for arg, name in _PAIR_FIELDS.items()}


PAIR_DEFAULTS = pair_options(_DATA)
PAIR_COLUMNS = ("prompt", "chosen", "rejected", "chosen_reward", "rejected_reward")


@dataclass
class Pair:
    prompt: Any
    chosen: Any
    rejected: Any
    chosen_reward: float | None = None
    rejected_reward: float | None = None
    tools: list[dict] | None = None  # tool schemas rendered into the prompt (a `tools` column)

    @property
    def margin(self) -> float | None:
        if self.chosen_reward is None or self.rejected_reward is None:
            return None
        return self.chosen_reward - self.rejected_reward


@dataclass
class PairReport:
    prompts_seen: int = 0
    prompts_without_chosen: int = 0  # no response with reward >= chosen_min
    prompts_without_rejected: int = 0  # no response with reward < rejected_max
    prompts_with_pairs: int = 0
    pairs_made: int = 0
    skipped_by_margin: int = 0  # chosen_reward - rejected_reward < min_margin
    skipped_identical: int = 0  # chosen and rejected are the same text (noisy labels): no signal
    skipped_by_cap: int = 0  # all_pairs beyond max_pairs_per_prompt

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)

    def format(self) -> str:
        return "\n".join([
            f"prompts seen: {self.prompts_seen}",
            f"prompts without a chosen response: {self.prompts_without_chosen}",
            f"prompts without a rejected response: {self.prompts_without_rejected}",
            f"prompts with pairs: {self.prompts_with_pairs}",
            f"pairs made: {self.pairs_made}",
            f"pairs skipped by min_margin: {self.skipped_by_margin}",
            f"pairs skipped, chosen == rejected: {self.skipped_identical}",
            f"pairs skipped by max_pairs_per_prompt: {self.skipped_by_cap}",
        ])


def group_by_prompt(traces: Sequence[Trace]) -> dict[str, list[Trace]]:
    """prompt_key -> its traces, prompts in first-appearance order, traces in load order."""
    groups: dict[str, list[Trace]] = {}
    for t in traces:
        groups.setdefault(prompt_key(t.prompt), []).append(t)
    return groups


def _check_pair_options(chosen_min, rejected_max, strategy,
                        max_pairs_per_prompt, min_margin) -> None:
    if strategy not in STRATEGIES:
        raise UserError(f"pair strategy must be one of {STRATEGIES}, got {strategy!r}")
    if chosen_min < rejected_max:
        # Otherwise one response could be both chosen and rejected.
        raise UserError(f"chosen_min ({chosen_min}) must be >= rejected_max ({rejected_max})")
    if max_pairs_per_prompt is not None and max_pairs_per_prompt < 1:
        raise UserError(f"max_pairs_per_prompt must be >= 1 or unset, got {max_pairs_per_prompt}")
    if min_margin < 0:
        raise UserError(f"min_margin must be >= 0, got {min_margin}")


def _candidates(chosen: list[tuple[int, Trace]], rejected: list[tuple[int, Trace]]):
    """Every (chosen, rejected), highest margin first; ties by chosen position, then rejected."""
    combos = [(c, r) for c in chosen for r in rejected]
    combos.sort(key=lambda cr: (-(cr[0][1].reward - cr[1][1].reward), cr[0][0], cr[1][0]))
    return [(c, r) for (_, c), (_, r) in combos]


def _best_vs_worst(chosen: list[tuple[int, Trace]], rejected: list[tuple[int, Trace]]):
    """[(best chosen, worst rejected)]; min/max keep the first of equal keys, i.e. the earliest."""
    best = min(chosen, key=lambda it: (-it[1].reward, it[0]))[1]
    worst = min(rejected, key=lambda it: (it[1].reward, it[0]))[1]
    return [(best, worst)]


def build_pairs(traces: Sequence[Trace], *, chosen_min: float = _DATA.chosen_min,
                rejected_max: float = _DATA.rejected_max, strategy: str = _DATA.pair_strategy,
                max_pairs_per_prompt: int | None = _DATA.max_pairs_per_prompt,
                min_margin: float = _DATA.min_margin) -> tuple[list[Pair], PairReport]:
    """DPO pairs per prompt.

    best_vs_worst: one pair, the highest-reward chosen vs the lowest-reward rejected.
    all_pairs: every chosen x rejected, highest margin (chosen_reward - rejected_reward) first,
    at most `max_pairs_per_prompt` kept per prompt. Pairs with margin < min_margin, or whose
    chosen and rejected texts are equal, are skipped and counted; the cap applies after them.
    """
    _check_pair_options(chosen_min, rejected_max, strategy, max_pairs_per_prompt, min_margin)
    report = PairReport()
    pairs: list[Pair] = []
    for group in group_by_prompt(traces).values():
        report.prompts_seen += 1
        indexed = list(enumerate(group))
        chosen = [it for it in indexed if it[1].reward >= chosen_min]
        rejected = [it for it in indexed if it[1].reward < rejected_max]
        report.prompts_without_chosen += not chosen
        report.prompts_without_rejected += not rejected
        if not chosen or not rejected:
            continue
        combos = (
            _best_vs_worst(chosen, rejected)
            if strategy == "best_vs_worst"
            else _candidates(chosen, rejected)
        )
        made = 0
        for c, r in combos:
            if c.reward - r.reward < min_margin:
                report.skipped_by_margin += 1
            elif prompt_key(c.response) == prompt_key(r.response):
                report.skipped_identical += 1
            elif max_pairs_per_prompt is not None and made >= max_pairs_per_prompt:
                report.skipped_by_cap += 1
            else:
                pairs.append(Pair(c.prompt, c.response, r.response, c.reward, r.reward,
                                  c.extra.get(TOOLS_COLUMN)))
                made += 1
        report.pairs_made += made
        report.prompts_with_pairs += made > 0
    return pairs, report


# ---------------------------------------------------------------------------------------------
# The pairs file
# ---------------------------------------------------------------------------------------------

def _column(values: list, name: str) -> pa.Array:
    """One arrow column; strings and chat messages cannot share a column, so say so."""
    import pyarrow as pa  # only when pairs are written: reading and building them needs no arrow

    kinds = {type(v).__name__ for v in values if v is not None}
    if len(kinds) > 1:
        raise UserError(f"pairs column {name!r} mixes {' and '.join(sorted(kinds))} values; use "
                        "plain strings or chat messages throughout the dataset")
    try:
        return pa.array(values)
    except (pa.ArrowException, TypeError) as e:
        raise UserError(f"cannot store pairs column {name!r}: {' '.join(str(e).split())}") from None


def pairs_table(pairs: Sequence[Pair]) -> pa.Table:
    import pyarrow as pa

    cols = {name: _column([getattr(p, name) for p in pairs], name) for name in PAIR_COLUMNS[:3]}
    for name in PAIR_COLUMNS[3:]:
        cols[name] = pa.array([getattr(p, name) for p in pairs], type=pa.float64())
    if not pairs:  # pa.array([]) is of null type; give readers string columns instead
        cols.update({name: pa.array([], type=pa.string()) for name in PAIR_COLUMNS[:3]})
    # JSON text: schemas differ per tool, a struct column would not
    if any(p.tools is not None for p in pairs):
        cols[TOOLS_COLUMN] = pa.array(
            [None if p.tools is None else json.dumps(p.tools) for p in pairs], pa.string()
        )
    return pa.table(cols)


def write_pairs(pairs: Sequence[Pair], out_path: str) -> None:
    """Write pairs as parquet (prompt, chosen, rejected, chosen_reward, rejected_reward).

    Atomic: a local file is written next to the target and moved over it with os.replace; a
    remote object is uploaded in one put. No half-written output is left on error.
    """
    import fsspec
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pairs_table(pairs)
    fs, fpath = fsspec.core.url_to_fs(str(out_path))
    if not is_local(fs):
        sink = pa.BufferOutputStream()  # arrow-owned memory, see traces.arrow_input
        pq.write_table(table, sink)
        fs.pipe_file(fpath, sink.getvalue().to_pybytes())
        return
    check_writable_file(fpath, where=str(out_path))
    with atomic_path(fpath) as tmp:
        pq.write_table(table, str(tmp))


def check_writable_file(path: str, where: str) -> None:
    """A local output file path must not be a folder nor lie under a file (UserError naming it)."""
    p = os.path.abspath(path)
    if os.path.isdir(p):
        raise UserError("is a folder; give a file name such as pairs.parquet", where=where)
    parent = os.path.dirname(p)
    while parent and not os.path.exists(parent):
        parent = os.path.dirname(parent) if os.path.dirname(parent) != parent else ""
    if parent and not os.path.isdir(parent):
        raise UserError(f"{parent} is a file, not a folder", where=where)


def read_pairs(path: str) -> list[Pair]:
    """Read a pairs file (prompt, chosen, rejected; reward columns optional) with row-level checks.
    Without a prompt column the prompt is implicit (TRL's format): `split_implicit_prompt`."""
    fs, files = resolve_files(path)
    pairs: list[Pair] = []
    for fpath in files:
        where = display_path(fs, fpath)
        rows, columns = read_rows(fs, fpath, text_columns=PAIR_COLUMNS[:3])
        require_columns(columns, PAIR_COLUMNS[1:3], where)
        implicit = "prompt" not in columns
        for i, row in enumerate(rows):
            if implicit:
                row = row | _implicit(row, f"{where} row {i}")
            pairs.append(_row_to_pair(row, f"{where} row {i}"))
    return pairs


def split_implicit_prompt(chosen, rejected):
    """TRL's implicit prompt: the longest common prefix of `chosen` and `rejected` (messages, or
    characters of two strings) is the prompt, the rest of each the response. Between strings a
    space where they part stays with the responses (TRL's rule). -> (prompt, chosen, rejected)."""
    n, limit = 0, min(len(chosen), len(rejected))
    while n < limit and chosen[n] == rejected[n]:
        n += 1
    if isinstance(chosen, str) and 0 < n and chosen[n - 1] == " ":
        n -= 1
    return chosen[:n], chosen[n:], rejected[n:]


def _implicit(row: dict, where: str) -> dict:
    chosen, rejected = row.get("chosen"), row.get("rejected")
    if type(chosen) is not type(rejected) or not isinstance(chosen, (str, list)):
        raise UserError("without a prompt column, chosen and rejected must both be conversations "
                        "(lists "
                        "of messages) or both text, the prompt being what they share", where=where)
    prompt, chosen, rejected = split_implicit_prompt(chosen, rejected)
    if not prompt:
        raise UserError("chosen and rejected share no prompt (no prompt column: the prompt is "
                        "their common beginning)", where=where)
    if not chosen or not rejected:
        raise UserError("chosen and rejected are equal up to the end of one: it has no response",
                        where=where)
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _row_to_pair(row: dict, where: str) -> Pair:
    values = {}
    for name in PAIR_COLUMNS[:3]:
        problem = text_problem(row.get(name), "prompt" if name == "prompt" else "response")
        if problem:
            raise UserError(problem[1], where=f"{where} column {name}")
        v = row[name]
        values[name] = normalize_messages(v) if isinstance(v, list) else v
    for name in PAIR_COLUMNS[3:]:
        v = row.get(name)
        if v is not None:
            problem = reward_problem(v, float("-inf"), float("inf"))
            if problem:
                raise UserError(problem[1], where=f"{where} column {name}")
            v = float(v)
        values[name] = v
    return Pair(**values,
                tools=parse_tools(row.get(TOOLS_COLUMN), where=f"{where} column {TOOLS_COLUMN}"))
