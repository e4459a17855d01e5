"""What a training job costs: GPUs x hours x price per GPU-hour, plus storage.

Every amount is a [min, max] range. Per iteration = compute + storage; per year = per iteration x
iterations a year. Hours are given, or estimated as tokens / (tokens/s/GPU x GPUs) x 1/3600, where
tokens = optimiser steps x sequences per step x tokens per sequence (the config's length limits
unless given) and the throughput is given or measured from a run's metrics.jsonl.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from preftune.data.pairs import pair_options
from preftune.data.prompts import load_prompts
from preftune.data.traces import TraceOptions
from preftune.errors import UserError

PRICES = Path(__file__).with_name("prices.yaml")
Range = tuple[float, float]
_RANGE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:-\s*(\d+(?:\.\d*)?|\.\d+)\s*)?$")


def parse_range(text: str | float | list, where: str) -> Range:
    """'10-15', '10', 10 or [10, 15] -> (10.0, 15.0); min <= max, both >= 0."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        lo = hi = float(text)
    elif (
        isinstance(text, list) and len(text) == 2 and all(isinstance(v, (int, float)) for v in text)
    ):
        lo, hi = map(float, text)
    else:
        m = _RANGE.match(str(text))
        if not m:
            raise UserError(f"expected a number or a range MIN-MAX, got {text!r}", where=where)
        lo = float(m.group(1))
        hi = float(m.group(2)) if m.group(2) else lo
    if lo < 0 or lo > hi:
        raise UserError(f"expected 0 <= min <= max, got {text!r}", where=where)
    return lo, hi


def load_prices(path: str | Path | None = None) -> dict:
    path = Path(path) if path else PRICES
    try:
        prices = yaml.safe_load(path.read_text()) or {}
    except OSError as e:
        raise UserError(f"cannot read prices: {e.strerror}", where=str(path)) from None
    except yaml.YAMLError as e:
        raise UserError(f"invalid YAML: {str(e).splitlines()[0]}", where=str(path)) from None
    if not isinstance(prices, dict):
        raise UserError("expected a mapping with gpu_hour_usd and storage", where=str(path))
    prices["source"] = str(path)
    return prices


def gpu_hour_price(prices: dict, instance_types: list[str], capacity_type: str) -> Range:
    """The widest range over the instance types the job may get."""
    table = prices.get("gpu_hour_usd") or {}
    ranges = []
    for itype in instance_types:
        value = (table.get(itype) or {}).get(capacity_type)
        if value is None:
            raise UserError(f"no {capacity_type} price for {itype}: add it "
                            "to gpu_hour_usd or pass --price-per-gpu-hour", where=prices["source"])
        ranges.append(parse_range(value,
                                  f"{prices['source']}: gpu_hour_usd.{itype}.{capacity_type}"))
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


def measured_throughput(metrics: str | Path, gpus_in_run: int = 1) -> Range:
    """tokens/s/GPU from a run's metrics.jsonl: the 10th-90th percentile of its steps'
    tokens_per_second (the first step, which includes warm-up, left out), divided by the GPUs that
    run used."""
    try:
        lines = Path(metrics).read_text().splitlines()
    except OSError as e:
        raise UserError(f"cannot read metrics: {e.strerror}", where=str(metrics)) from None
    values = []
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                raise UserError("not JSON", where=f"{metrics} line {i}") from None
            if isinstance(record.get("tokens_per_second"), (int, float)):
                values.append(float(record["tokens_per_second"]))
    values = sorted(values[1:] if len(values) > 1 else values)
    if not values:
        raise UserError("no tokens_per_second records", where=str(metrics))

    def quantile(q):
        return values[min(len(values) - 1, round(q * (len(values) - 1)))]
    return quantile(0.1) / gpus_in_run, quantile(0.9) / gpus_in_run


@dataclass
class Workload:
    """The tokens one training iteration processes, and how they were counted."""
    steps: int
    sequences_per_step: int
    tokens_per_sequence: int
    samples: int | None = None  # prompts or pairs in the data, when counted for --epochs
    epochs: float | None = None

    @property
    def tokens(self) -> int:
        return self.steps * self.sequences_per_step * self.tokens_per_sequence


def count_samples(cfg) -> int:
    """Prompts (online GRPO), trace groups (offline GRPO), pairs (DPO) or examples (KTO) the
    config's data gives."""
    # numpy, arrow: not for `preftune train`, whose parser names cost
    from preftune.data import inspect as commands

    if cfg.algorithm == "grpo" and cfg.grpo.rollout == "online":
        return len(load_prompts(cfg.data.train, prompt_column=cfg.data.prompt_column))
    report = commands.inspect_report(cfg.data.train, TraceOptions.from_config(cfg.data),
                                     **pair_options(cfg.data))
    if cfg.algorithm == "kto":
        return report["kto"]["examples"]
    return report["dpo"]["pairs_made"] if cfg.algorithm == "dpo" else report["grpo"]["groups_made"]


def workload(cfg, *, epochs: float | None = None, samples: int | None = None,
             tokens_per_sequence: int | None = None) -> Workload:
    if cfg.algorithm == "dpo":  # chosen and rejected: two sequences per pair
        items, per_item, length = cfg.dpo.batch_size, 2, cfg.dpo.max_length
    # each example and its mismatched pair (a forward without gradients)
    elif cfg.algorithm == "kto":
        items, per_item, length = (
            cfg.kto.batch_size,
            2 if cfg.kto.loss_type == "kto" else 1,
            cfg.kto.max_length,
        )
    else:
        items, per_item = cfg.grpo.prompts_per_step, cfg.grpo.num_generations
        length = cfg.data.max_prompt_length + cfg.grpo.max_completion_length
    steps = cfg.max_steps
    if epochs is not None and samples is None:
        try:
            samples = count_samples(cfg)
        except UserError as e:
            raise UserError(f"cannot count the training samples ({e}); pass --samples N") from None
    if epochs is not None:
        steps = max(1, math.ceil(epochs * samples / items))
    return Workload(steps, items * per_item, tokens_per_sequence or length, samples, epochs)


@dataclass
class CostInputs:
    nodes: int
    gpus_per_node: int
    capacity_type: str
    instance_types: list[str]
    price_per_gpu_hour: Range
    hours: Range
    fsx_usd: Range = (0.0, 0.0)
    s3_usd: Range = (0.0, 0.0)
    iterations_per_year: int = 1
    hours_from: dict = field(default_factory=dict)  # how hours were estimated, when they were

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def storage_usd(fixed: Range | None, gb: float | None, gb_month_price: float,
                months: float) -> Range:
    if fixed is not None:
        return fixed
    return (gb or 0.0) * gb_month_price * months, (gb or 0.0) * gb_month_price * months


def hours_from_throughput(work: Workload, tokens_per_second_per_gpu: Range, gpus: int) -> Range:
    lo_tps, hi_tps = tokens_per_second_per_gpu
    if lo_tps <= 0:
        raise UserError("throughput must be > 0", where="--tokens-per-second-per-gpu")
    return work.tokens / (hi_tps * gpus) / 3600, work.tokens / (lo_tps * gpus) / 3600


def estimate(inp: CostInputs) -> dict:
    """The JSON report: every amount a [min, max] pair in USD, and the inputs used."""
    compute = [inp.gpus * inp.hours[0] * inp.price_per_gpu_hour[0],
               inp.gpus * inp.hours[1] * inp.price_per_gpu_hour[1]]
    storage = [inp.fsx_usd[0] + inp.s3_usd[0], inp.fsx_usd[1] + inp.s3_usd[1]]
    total = [compute[0] + storage[0], compute[1] + storage[1]]
    inputs = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(inp).items()}
    inputs["gpus"] = inp.gpus
    return {"compute_usd": compute, "storage_usd": storage, "total_usd": total,
            "annual_usd": [total[0] * inp.iterations_per_year, total[1] * inp.iterations_per_year],
            "inputs": inputs}


def money(r) -> str:
    lo, hi = (f"${v:,.0f}" if v >= 100 or v == round(v) else f"${v:,.2f}" for v in r)
    return lo if lo == hi else f"{lo}-{hi.lstrip('$')}"


def number(r) -> str:
    return f"{r[0]:g}" if r[0] == r[1] else f"{r[0]:g}-{r[1]:g}"


def format_estimate(report: dict) -> str:
    i = report["inputs"]
    lines = [f"{i['gpus']} GPUs ({i['nodes']} x {i['gpus_per_node']}, {i['capacity_type']} "
             f"{', '.join(i['instance_types'])}) x {number([round(h, 2) for h in i['hours']])} "
             f"hours x ${number(i['price_per_gpu_hour'])} per GPU-hour"]
    if i["hours_from"]:
        h = i["hours_from"]
        lines.append(f"  hours estimated: {h['tokens']:,} tokens ({h['steps']} steps x "
                     f"{h['sequences_per_step']} sequences x {h['tokens_per_sequence']} tokens) at "
                     f"{number(h['tokens_per_second_per_gpu'])} tokens/s/GPU")
    lines += [f"compute:        {money(report['compute_usd'])}",
              f"storage:        {money(report['storage_usd'])} (FSx {money(i['fsx_usd'])}, S3 "
              f"{money(i['s3_usd'])})",
              f"per iteration:  {money(report['total_usd'])}",
              f"per year:       {money(report['annual_usd'])} "
              f"({i['iterations_per_year']} iterations)"]
    return "\n".join(lines)
