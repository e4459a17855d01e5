"""The `preftune` command: train | data inspect | data pairs | launch | export.

Exit codes: 0 finished · 75 preempted, checkpoint saved, resume me · 78 config or data error
(one line, no traceback) · 1 anything else.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from preftune.errors import EXIT_CRASH, EXIT_OK, EXIT_PREEMPTED, EXIT_USER, Preempted, UserError


def _trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("path", help="a trace file, folder or glob (parquet, jsonl, csv; local or s3://)")
    p.add_argument("--prompt-column", default="input")
    p.add_argument("--response-column", default="output")
    p.add_argument("--reward-column", default="final_reward")
    p.add_argument("--reward-range", type=float, nargs=2, default=(0.0, 1.0), metavar=("LO", "HI"))
    p.add_argument("--invalid", choices=("error", "drop"), default="error", help="policy for invalid rows")
    p.add_argument("--duplicates", choices=("error", "drop", "keep"), default="drop")
    p.add_argument("--min-reward-threshold", type=float, default=None)
    p.add_argument("--chosen-min", type=float, default=0.7)
    p.add_argument("--rejected-max", type=float, default=0.5)
    p.add_argument("--strategy", choices=("best_vs_worst", "all_pairs"), default="best_vs_worst")
    p.add_argument("--max-pairs-per-prompt", type=int, default=None)
    p.add_argument("--min-margin", type=float, default=0.0)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="preftune", description="Preference and reward fine-tuning (GRPO family, DPO).")
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train a model from a YAML config")
    tr.add_argument("config", help="YAML config file")
    tr.add_argument("overrides", nargs="*", help="dotted KEY=VALUE overrides, e.g. grpo.beta=0.04")
    data = sub.add_parser("data", help="inspect labeled traces and build DPO pairs")
    dsub = data.add_subparsers(dest="data_command", required=True)
    ins = dsub.add_parser("inspect", help="summarise a trace dataset")
    _trace_args(ins)
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    pairs = dsub.add_parser("pairs", help="write DPO pairs (prompt, chosen, rejected, rewards) to parquet")
    _trace_args(pairs)
    pairs.add_argument("-o", "--output", required=True, help="output .parquet file")
    from preftune import launch
    from preftune.train import export

    launch.add_parser(sub)
    export.add_parser(sub)
    return ap


def _options(args):
    from preftune.data.traces import TraceOptions

    return TraceOptions(prompt_column=args.prompt_column, response_column=args.response_column,
                        reward_column=args.reward_column, reward_range=tuple(args.reward_range),
                        invalid=args.invalid, duplicates=args.duplicates,
                        min_reward_threshold=args.min_reward_threshold)


def _pair_kwargs(args) -> dict:
    return dict(chosen_min=args.chosen_min, rejected_max=args.rejected_max, strategy=args.strategy,
                max_pairs_per_prompt=args.max_pairs_per_prompt, min_margin=args.min_margin)


def _train(args) -> None:
    from preftune.config import load_config
    from preftune.train.loop import train

    cfg = load_config(args.config, args.overrides)
    final = train(cfg)
    evals = _eval_rewards(final.parent / "metrics.jsonl")
    if len(evals) >= 2:
        print(f"eval/reward: {evals[0]:.3f} (step 0) -> {evals[-1]:.3f} (last step)")
    print(f"done. model: {final}\n      metrics: {final.parent / 'metrics.jsonl'}")


def _eval_rewards(path) -> list[float]:
    records = [json.loads(line) for line in open(path) if line.strip()]
    return [r["eval/reward"] for r in records if r.get("eval/reward") is not None]


def _data(args) -> None:
    from preftune.data import commands

    if args.data_command == "inspect":
        report = commands.inspect_report(args.path, _options(args), **_pair_kwargs(args))
        print(json.dumps(report, indent=1) if args.json else commands.format_inspect(report))
    else:
        print(commands.pairs_command(args.path, args.output, _options(args), **_pair_kwargs(args)))


def main(argv: list[str] | None = None) -> int:
    """Under `preftune launch` (PREFTUNE_STATUS_DIR set), a worker records its pid (the launcher
    forwards SIGTERM to it) and its exit code (torchrun itself reports 1 for any failed worker)."""
    from preftune import launch

    status = launch.worker_status_dir()
    if status is not None:
        launch.write_status(status, "pid", os.getpid())
    code = _main(argv)
    if status is not None:
        launch.write_status(status, "exit", code)
    return code


def _main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    rank = f" rank {os.environ['RANK']}" if "LOCAL_RANK" in os.environ and "RANK" in os.environ else ""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s" + rank + " %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    try:  # transformers' own progress bars (loading/writing shards) would bury ours
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except ImportError:
        pass
    for noisy in ("httpx", "urllib3", "botocore", "s3fs", "fsspec", "aiobotocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        if hasattr(args, "handler"):  # subcommands registered by their own modules (launch, export)
            return args.handler(args)
        _train(args) if args.command == "train" else _data(args)
    except UserError as e:
        print(f"preftune: error: {e}", file=sys.stderr)
        return EXIT_USER
    except Preempted as e:
        print(f"preftune: {e}", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        print("preftune: interrupted", file=sys.stderr)
        return EXIT_CRASH
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
