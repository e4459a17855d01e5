"""One trace pipeline, for every algorithm that trains on labeled traces:

    read and validate (data.*) -> leave out the held-out prompts (eval.split) -> build -> report

and a builder at its end: `pair_builder` (DPO), `label_builder` (KTO), `group_builder` (offline
GRPO), `example_builder` (SFT). A builder turns the traces into what its algorithm trains on and
counts what it left out; `trace_items` stops with one line naming why nothing is left, counting the
rows dropped before.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from preftune.data.groups import build_groups
from preftune.data.pairs import build_pairs, pair_options, read_pairs
from preftune.data.prompts import PromptSet, load_prompts
from preftune.data.sft import TRACES, Example, detect_format, read_trl
from preftune.data.tools import TOOLS_COLUMN
from preftune.data.split import drop_held_out, is_held_out, split_prompt_set
from preftune.data.traces import (Trace, TraceOptions, dropped_note,
                                  load_traces, prompt_key, read_rows, resolve_files)
from preftune.errors import UserError


@dataclass(frozen=True)
class Built:
    items: list  # what the algorithm trains on
    report: dict  # the builder's counts
    empty: str = ""  # why nothing was built (when items is empty)


Builder = Callable[[list[Trace]], Built]


def trace_items(path: str, opts: TraceOptions, name: str, build: Builder, *,
                split: float = 0.0) -> tuple[list, dict]:
    """(items, data report) from labeled traces: the report has the rows read and dropped
    ("traces"), the held-out rows (with `split`), and the builder's counts under `name`."""
    traces, drops = load_traces(path, opts)
    traces, held_out = drop_held_out(list(traces), split)
    built = build(traces)
    if not built.items:
        raise UserError(built.empty + dropped_note(drops), where=path)
    return built.items, {"traces": drops.as_dict(), name: built.report} | (
        {"held_out_rows": held_out} if split else {}
    )


def pair_builder(data) -> Builder:
    """DPO pairs per prompt (data.chosen_min, rejected_max, pair_strategy, ...)."""
    def build(traces: list[Trace]) -> Built:
        pairs, r = build_pairs(traces, **pair_options(data))
        why = "no trace rows left" if not traces else (
            f"{r.prompts_seen} prompts, {r.prompts_without_chosen} without a chosen "
            f"(data.chosen_min), {r.prompts_without_rejected} without a rejected "
            f"(data.rejected_max), {r.skipped_by_margin} below data.min_margin, "
            f"{r.skipped_identical} with chosen == rejected")
        return Built(pairs, r.as_dict(), f"no DPO pairs to train on: {why}")
    return build


@dataclass(frozen=True)
class Labeled:
    """A response on its own, desirable or not (KTO's unpaired example)."""

    prompt: Any
    completion: Any
    desirable: bool
    tools: list[dict] | None = None  # tool schemas rendered into the prompt


def label_builder(chosen_min: float, rejected_max: float) -> Builder:
    """KTO: each response desirable (reward >= data.chosen_min) or undesirable (<
    data.rejected_max), DPO's thresholds; a response in between is left out and counted."""
    def build(traces: list[Trace]) -> Built:
        kept, between = [], 0
        for t in traces:
            if t.reward >= chosen_min or t.reward < rejected_max:
                kept.append(Labeled(t.prompt, t.response, t.reward >= chosen_min,
                                    t.extra.get(TOOLS_COLUMN)))
            else:
                between += 1
        desirable = sum(e.desirable for e in kept)
        report = {"examples": len(kept), "desirable": desirable,
                  "undesirable": len(kept) - desirable, "between_thresholds": between}
        why = "no trace rows left" if not traces else (
            f"all {len(traces)} rows have data.rejected_max={rejected_max} <= reward < "
            f"data.chosen_min={chosen_min}")
        return Built(kept, report, f"no KTO example to train on: {why}")
    return build


def group_builder(traces: list[Trace]) -> Built:
    """Offline GRPO: one group per prompt, its labeled responses."""
    groups, r = build_groups(traces)
    return Built(groups, r.as_dict(),
                 "no usable GRPO group (each needs >= 2 responses with different "
                 f"rewards; {r.too_small} prompts too small, "
                 f"{r.zero_spread} with equal rewards)")


def example_builder(min_reward: float) -> Builder:
    """SFT on the responses with reward >= sft.min_reward (rejection sampling)."""
    def build(traces: list[Trace]) -> Built:
        kept = [
            Example(t.prompt, t.response, t.extra.get(TOOLS_COLUMN))
            for t in traces
            if t.reward >= min_reward
        ]
        return Built(kept, {"examples": len(kept), "below_min_reward": len(traces) - len(kept)},
                     f"no response has reward >= sft.min_reward={min_reward} "
                     f"({len(traces)} valid rows)")
    return build


def columns(path: str) -> list[str]:
    """The columns of the first non-empty file."""
    fs, files = resolve_files(path)
    return next((c for c in (read_rows(fs, f)[1] for f in files) if c), None) or []


def load_pairs(cfg) -> tuple[list, dict]:
    """A pairs file (prompt/chosen/rejected columns, or chosen/rejected with the prompt implicit:
    TRL's formats) or labeled traces paired (data.*)."""
    path, split = cfg.data.train, cfg.eval.split
    if {"chosen", "rejected"} <= set(columns(path)):
        pairs, held_out = drop_held_out(read_pairs(path), split)
        return pairs, {"pairs_file": len(pairs)} | ({"held_out_pairs": held_out} if split else {})
    return trace_items(path, TraceOptions.from_config(cfg.data), "pairs",
                       pair_builder(cfg.data), split=split)


def load_labeled(cfg) -> tuple[list[Labeled], dict]:
    """KTO's labeled responses from traces (data.*) and the data report."""
    return trace_items(cfg.data.train, TraceOptions.from_config(cfg.data), "kto",
                       label_builder(cfg.data.chosen_min,
                                     cfg.data.rejected_max), split=cfg.eval.split)


def load_examples(path: str, opts: TraceOptions, min_reward: float, *,
                  split: float = 0.0) -> tuple[list, dict]:
    """SFT examples from labeled traces, TRL prompt/completion or messages files, and the report."""
    fmt = detect_format(path)
    if fmt == TRACES:
        items, report = trace_items(path, opts, "sft", example_builder(min_reward), split=split)
        return items, {"format": fmt} | report
    examples, drops = read_trl(path, fmt, opts)
    if not examples:
        raise UserError(
            "no usable SFT example" + (dropped_note(drops) or " (the files have no rows)"),
            where=path,
        )
    examples, held_out = drop_held_out(examples, split)
    return examples, {"format": fmt, "rows": drops.as_dict(),
                      "sft": {"examples": len(examples)}} | (
        {"held_out_examples": held_out} if split else {})


def held_out_prompts(path: str, fraction: float, opts: TraceOptions) -> PromptSet:
    """The held-out prompts of a training set: a prompt file's rows, or the distinct prompts of
    traces, prompt/completion or messages files (with the other columns of each prompt's first
    row)."""
    fmt, cols = detect_format(path), columns(path)
    rows: list[tuple[Any, dict]]
    if fmt == TRACES and opts.response_column in cols and opts.reward_column in cols:
        traces, _ = load_traces(path, opts)
        rows = [(t.prompt, t.extra) for t in traces]
    elif fmt == TRACES:
        ps = split_prompt_set(load_prompts(path, prompt_column=opts.prompt_column),
                              fraction, held_out=True)
        if not len(ps):
            raise UserError(f"eval.split={fraction} holds out no prompt of {len(ps)}", where=path)
        return ps
    else:
        rows = [(e.prompt, {}) for e in read_trl(path, fmt, opts)[0]]
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
