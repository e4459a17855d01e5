"""Bodies of `preftune data inspect` and `preftune data pairs` (argparse lives in
preftune/cli/command.py)."""
from __future__ import annotations

import math
from collections import Counter
from typing import Any

import numpy as np

from preftune.data.groups import build_groups
from preftune.data.pairs import (
    PAIR_DEFAULTS,
    build_pairs,
    check_writable_file,
    group_by_prompt,
    write_pairs,
)
from preftune.data.pipeline import label_builder
from preftune.data.traces import DropReport, TraceOptions, load_traces, dropped_note
from preftune.errors import UserError

QUANTILES = (0.1, 0.25, 0.5, 0.75, 0.9)
HIST_BINS = 10
BAR_WIDTH = 40


def reward_stats(rewards: list[float], reward_range: tuple[float, float]) -> dict[str, Any] | None:
    """min/mean/std/max, quantiles (linear interpolation) and a histogram over reward_range.

    Bins span reward_range when it is finite (so runs are comparable), else the data's own span;
    the last bin is closed on the right.
    """
    if not rewards:
        return None
    r = np.asarray(rewards, dtype=np.float64)  # (N,)
    lo, hi = reward_range
    if not (math.isfinite(lo) and math.isfinite(hi)) or lo == hi:
        lo, hi = float(r.min()), float(r.max())
    if lo == hi:  # a single value: one bin around it
        lo, hi = lo - 0.5, hi + 0.5
    counts, edges = np.histogram(r, bins=HIST_BINS, range=(lo, hi))
    return {
        "count": int(r.size), "min": float(r.min()), "mean": float(r.mean()), "std": float(r.std()),
        "max": float(r.max()),
        "quantiles": {f"p{round(q * 100)}": float(np.quantile(r, q)) for q in QUANTILES},
        "histogram": {"edges": [float(e) for e in edges], "counts": [int(c) for c in counts]},
    }


def inspect_report(path: str, opts: TraceOptions, *, min_group_size: int = 2,
                   **pair_options) -> dict[str, Any]:
    """A JSON-ready summary of a trace dataset and what DPO, KTO and offline GRPO would get from it.
    `pair_options`: build_pairs' keywords (defaults: the config's, `PAIR_DEFAULTS`)."""
    pair_options = PAIR_DEFAULTS | pair_options
    traces, drops = load_traces(path, opts)
    by_prompt = group_by_prompt(traces)
    sizes = Counter(len(g) for g in by_prompt.values())
    _, pair_report = build_pairs(traces, **pair_options)
    _, group_report = build_groups(traces, min_size=min_group_size)
    return {
        "path": str(path),
        "files": traces.files,
        "rows": len(traces),
        "prompts": len(by_prompt),
        # JSON object keys are strings: "k" -> number of prompts with k responses.
        "responses_per_prompt": {str(k): sizes[k] for k in sorted(sizes)},
        "reward": reward_stats([t.reward for t in traces], opts.reward_range),
        "drops": drops.as_dict(),
        "dpo": {**pair_options, **pair_report.as_dict()},
        "kto": {"chosen_min": pair_options["chosen_min"],
                "rejected_max": pair_options["rejected_max"],
                **label_builder(pair_options["chosen_min"],
                                pair_options["rejected_max"])(list(traces)).report},
        "grpo": {"min_group_size": min_group_size, **group_report.as_dict()},
    }


def _histogram_lines(hist: dict[str, list]) -> list[str]:
    edges, counts = hist["edges"], hist["counts"]
    top = max(counts) or 1
    lines = []
    for i, c in enumerate(counts):
        close = "]" if i == len(counts) - 1 else ")"
        bar = "#" * math.ceil(BAR_WIDTH * c / top) if c else ""
        lines.append(f"  [{edges[i]:7.3f}, {edges[i + 1]:7.3f}{close} {c:>8}  {bar}")
    return lines


def format_inspect(report: dict[str, Any]) -> str:
    """The inspect report as text for a terminal."""
    lines = [f"dataset: {report['path']} ({len(report['files'])} file(s))",
             f"rows kept: {report['rows']}   distinct prompts: {report['prompts']}",
             "responses per prompt (k: prompts):",
             "  " + ", ".join(f"{k}: {n}" for k, n in report["responses_per_prompt"].items())]
    r = report["reward"]
    if r is None:
        lines.append("reward: no rows")
    else:
        q = "  ".join(f"{k} {v:.4g}" for k, v in r["quantiles"].items())
        lines += [f"reward: min {r['min']:.4g}  mean {r['mean']:.4g} "
                  f" std {r['std']:.4g}  max {r['max']:.4g}",
                  f"  {q}", *_histogram_lines(r["histogram"])]
    d = report["drops"]
    lines.append(f"rows read: {d['total_rows']}   kept: {d['kept']}")
    lines += [f"  dropped {reason}: {n}" for reason, n in d["dropped"].items()]
    p = report["dpo"]
    lines += [f"DPO pairs ({p['strategy']}, chosen >= {p['chosen_min']}, rejected < "
              f"{p['rejected_max']}, min_margin {p['min_margin']}): {p['pairs_made']}",
              f"  prompts without a chosen: {p['prompts_without_chosen']}   without a rejected: "
              f"{p['prompts_without_rejected']}",
              f"  skipped by margin: {p['skipped_by_margin']}   identical: "
              f"{p['skipped_identical']}   by cap: {p['skipped_by_cap']}"]
    k = report["kto"]
    lines.append(f"KTO examples (desirable >= {k['chosen_min']}, undesirable < "
                 f"{k['rejected_max']}): {k['examples']} ({k['desirable']} desirable, "
                 f"{k['undesirable']} undesirable; {k['between_thresholds']} in between, left out)")
    g = report["grpo"]
    lines += [f"GRPO groups (min size {g['min_group_size']}): {g['groups_made']} "
              f"({g['responses_in_groups']} responses)",
              f"  left out, too small: {g['too_small']}   all rewards equal: {g['zero_spread']}"]
    return "\n".join(lines)


def pairs_command(path: str, out: str, opts: TraceOptions, **pair_options) -> str:
    """Build DPO pairs from a trace dataset, write them to `out` and return the printable report.

    Zero pairs is a UserError: an empty pairs file would only fail later, in training.
    """
    if "://" not in str(out):  # before the (possibly long) read: a bad -o fails at once
        check_writable_file(out, where=f"-o {out}")
    pair_options = PAIR_DEFAULTS | pair_options
    traces, drops = load_traces(path, opts)
    pairs, report = build_pairs(traces, **pair_options)
    if not pairs:
        if not traces:
            raise UserError("no DPO pairs: no rows left" + dropped_note(drops), where=str(path))
        lo, hi = pair_options["chosen_min"], pair_options["rejected_max"]
        raise UserError(
            f"no DPO pairs: {report.prompts_seen} prompts, {report.prompts_without_chosen} without "
            f"a chosen (reward >= --chosen-min {lo}), {report.prompts_without_rejected} without a "
            f"rejected (reward < --rejected-max {hi}), {report.skipped_by_margin} below "
            f"--min-margin, {report.skipped_identical} "
            "with chosen == rejected" + dropped_note(drops), where=str(path))
    write_pairs(pairs, out)
    return "\n".join([f"wrote {len(pairs)} pairs to {out}", report.format(), _drops_text(drops)])


def _drops_text(drops: DropReport) -> str:
    return "traces: " + drops.format()
