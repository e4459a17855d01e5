"""The `preftune` command: train | data inspect | data pairs | eval | registry list | report |
launch | export
| render | cost | plan.

`script` is the process's first line (the console script, `python -m preftune`, `python -m
preftune.cli`): it installs the SIGTERM/SIGINT handler (exit 75, never 143) before torch or anything
heavy is imported, so this module imports nothing heavy at its top (tests/run/test_completion.py
checks it).

Exit codes (preftune/errors.py): 0 finished · 75 stopped with nothing lost, run again · 69
checkpoint storage or a tracker unreachable · 78 config or data error (one line, no traceback) · 3
`preftune eval`: the checkpoint failed its gate · 1 anything else.
"""
from __future__ import annotations

import argparse
import atexit
import dataclasses
import json
import logging
import os
import sys
import typing

from preftune.cli import export, launch
from preftune.cli.evaluate import add_parser as add_eval_parsers
from preftune.cli.report import add_parser as add_report_parser
from preftune.errors import EXIT_CRASH, EXIT_OK, EXIT_USER, TryAgain, Unavailable, UserError
from preftune.run.preemption import install_process_handler, process_handler


class ArgumentParser(argparse.ArgumentParser):
    """A usage error is a user error: one line, exit 78 (argparse's own code, 2, is not in our
    table).

    Subparsers inherit this class (argparse builds them with the parent's type), so a subcommand
    added with `add_parser(subparsers)` in its own module gets the same behaviour.
    """

    def error(self, message: str):
        print(f"{self.prog}: error: {message} (see {self.prog} --help)", file=sys.stderr)
        sys.exit(EXIT_USER)


# `preftune data` flags -> DataConfig fields; defaults, types and choices come from the dataclass.
DATA_FLAGS = {"--prompt-column": "prompt_column", "--response-column": "response_column",
              "--reward-column": "reward_column", "--reward-range": "reward_range",
              "--invalid": "invalid",
              "--duplicates": "duplicates", "--min-reward-threshold": "min_reward_threshold",
              "--chosen-min": "chosen_min", "--rejected-max": "rejected_max",
              "--strategy": "pair_strategy",
              "--max-pairs-per-prompt": "max_pairs_per_prompt", "--min-margin": "min_margin"}


def _trace_args(p: argparse.ArgumentParser) -> None:
    from preftune.config import DataConfig

    p.add_argument("path",
                   help="a trace file, folder or glob (parquet, jsonl, csv; local or s3://)")
    defaults, hints = DataConfig(), typing.get_type_hints(DataConfig)
    fields = {f.name: f for f in dataclasses.fields(DataConfig)}
    for flag, name in DATA_FLAGS.items():
        tp = next(
            t for t in (str, int, float) if t == hints[name] or t in typing.get_args(hints[name])
        )
        meta = fields[name].metadata
        kwargs = dict(dest=name, default=getattr(defaults, name),
                      help=f"{meta['help']} (data.{name} in a config; default: %(default)s)")
        if name == "reward_range":
            kwargs.update(type=float, nargs=2, metavar=("LO", "HI"))
        else:
            kwargs.update(type=tp, choices=meta["choices"] or None)
        p.add_argument(flag, **kwargs)


def parser() -> argparse.ArgumentParser:
    ap = ArgumentParser(prog="preftune",
                        description="Preference and reward fine-tuning (GRPO family, DPO).")
    sub = ap.add_subparsers(dest="command", required=True)
    tr = sub.add_parser("train", help="train a model from a YAML config")
    tr.add_argument("config", help="YAML config file")
    tr.add_argument("overrides", nargs="*", default=[],
                    help="dotted KEY=VALUE overrides, e.g. grpo.beta=0.04")
    data = sub.add_parser("data", help="inspect labeled traces and build DPO pairs")
    dsub = data.add_subparsers(dest="data_command", required=True)
    ins = dsub.add_parser("inspect", help="summarise a trace dataset")
    _trace_args(ins)
    ins.add_argument("--json", action="store_true", help="print the report as JSON")
    pairs = dsub.add_parser("pairs",
                            help="write DPO pairs (prompt, chosen, rejected, rewards) to parquet")
    _trace_args(pairs)
    pairs.add_argument("-o", "--output", required=True, help="output .parquet file")

    add_eval_parsers(sub)  # eval, registry list: each sets args.handler
    add_report_parser(sub)
    launch.add_parser(sub)
    export.add_parser(sub)
    from preftune.cli.deploy import add_parser as add_deploy_parsers

    add_deploy_parsers(sub)  # render, cost, plan
    return ap


def _data_overrides(ap, args, extra: list[str]) -> None:
    """data.KEY=VALUE after a data command: the same keys as its flags, typed as in a config
    file."""
    import yaml

    from preftune.config import DataConfig, from_dict

    for item in extra:
        key, raw = item.split("=", 1)
        name = key.removeprefix("data.")
        if name not in DATA_FLAGS.values():
            ap.error(f"{key} is not an option of `preftune data` (those are: "
                     f"{', '.join('data.' + n for n in DATA_FLAGS.values())})")
        try:
            value = yaml.safe_load(raw) if raw else ""
        except yaml.YAMLError:
            value = raw
        setattr(args, name, getattr(from_dict(DataConfig, {name: value}, "data."), name))
        args.dotted = {*getattr(args, "dotted", ()), name}  # errors name what the user typed


def _data_section(args):
    """The `data` flags as a checked DataConfig (the same ranges as in a config file)."""
    from preftune.config import DataConfig, check_section

    d = DataConfig(**{name: getattr(args, name) for name in DATA_FLAGS.values()})
    d.reward_range = list(d.reward_range)
    try:
        check_section(d, "data.")
    except UserError as e:  # name the flag the user typed
        flags = {
            f"data.{name}": flag
            for flag, name in DATA_FLAGS.items()
            if name not in getattr(args, "dotted", ())
        }
        key = (e.where or "").split("[")[0]
        raise UserError(e.message, where=flags.get(key, key)) from None
    return d


def _train(args) -> None:
    from preftune.config import load_config
    from preftune.run.completion import completed

    # before torch: a finished run exits at once
    done = completed(load_config(args.config, args.overrides))
    if done is not None:
        if process_handler() is not None:
            process_handler().complete()  # a notice from here on changes nothing
        print(f"preftune: already complete: {done}; nothing to do")
        return
    from preftune.api import train  # the command line is a thin layer over the Python API

    result = train(args.config, overrides=args.overrides)
    evals = [r["eval/reward"] for r in result.eval if r.get("eval/reward") is not None]
    if len(evals) >= 2:
        print(f"eval/reward: {evals[0]:.3f} (step 0) -> {evals[-1]:.3f} (last step)")
    print(f"done. model: {result.model_path}\n      metrics: {result.metrics_path}")


def _data(args) -> None:
    from preftune.data import inspect as commands
    from preftune.data.pairs import pair_options
    from preftune.data.traces import TraceOptions

    stop = process_handler()
    # files may be written from here: a signal unwinds (exit 75) instead of exiting at once
    if stop is not None:
        stop.setup(stop.grace)

    d = _data_section(args)
    opts = TraceOptions.from_config(d)
    if args.data_command == "inspect":
        report = commands.inspect_report(args.path, opts, **pair_options(d))
        print(json.dumps(report, indent=1) if args.json else commands.format_inspect(report))
    else:
        print(commands.pairs_command(args.path, args.output, opts, **pair_options(d)))


def main(argv: list[str] | None = None) -> int:
    """Under `preftune launch` (PREFTUNE_STATUS_DIR set), a worker records its pid (the launcher
    forwards SIGTERM to it) and its exit code (torchrun itself reports 1 for any failed worker)."""
    status = launch.worker_status_dir()
    if status is not None:
        launch.write_status(status, "pid", os.getpid())
    code = _main(argv)
    if status is not None:
        launch.write_status(status, "exit", code)
    return code


def _main(argv: list[str] | None = None) -> int:
    ap = parser()
    args, extra = ap.parse_known_args(argv)
    # KEY=VALUE overrides may follow options (`render CONFIG -o DIR KEY=VALUE`)
    if (
        extra
        and hasattr(args, "overrides")
        and all("=" in e and not e.startswith("-") for e in extra)
    ):
        args.overrides = [*args.overrides, *extra]
    elif (
        extra and args.command == "data" and all(e.startswith("data.") and "=" in e for e in extra)
    ):
        # `preftune data inspect F data.invalid=drop`, as train takes them
        _data_overrides(ap, args, extra)
    elif extra:
        ap.error(f"unrecognized arguments: {' '.join(extra)}")
    rank = (
        f" rank {os.environ['RANK']}" if "LOCAL_RANK" in os.environ and "RANK" in os.environ else ""
    )
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s" + rank + " %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    for noisy in ("httpx", "urllib3", "botocore", "s3fs", "fsspec", "aiobotocore"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        handler = getattr(args, "handler", None)
        if handler is not None:
            return handler(args)
        _train(args) if args.command == "train" else _data(args)
    except UserError as e:
        print(f"preftune: error: {e}", file=sys.stderr)
        return EXIT_USER
    except (TryAgain, Unavailable) as e:  # 75: run again; 69: a service is unreachable
        print(f"preftune: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("preftune: interrupted", file=sys.stderr)
        return EXIT_CRASH
    return EXIT_OK



def script(argv: list[str] | None = None) -> None:
    """The process entry: the signal handler first, then the command, then `finish`."""
    install_process_handler()
    finish(main(argv))


def finish(code: int) -> None:
    """Exit the process with `code` without the interpreter's teardown: with torch loaded it takes
    seconds (every restart after a spot notice pays them), and CPython restores the default SIGTERM
    action early in it, so a late notice would turn a finished run into 143. What matters of the
    teardown is done first: exit handlers (logging's flush among them) and the standard streams."""
    try:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
    finally:
        os._exit(code)
