"""`preftune render`, `preftune cost` and `preftune plan`: argparse setup and handlers (registered
by cli.py)."""
from __future__ import annotations

import json
from pathlib import Path

import yaml

from preftune.atomic import atomic_write
from preftune.config import CHOICES, DeployConfig, apply_override, load_config, read_source
from preftune.deploy import cost
from preftune.deploy import plan as planner
from preftune.deploy.plan_text import format_plan
from preftune.deploy.nodes import instance_type
from preftune.deploy.cost import format_estimate
from preftune.deploy.render import render_objects
from preftune.deploy.validate import schema_problems
from preftune.errors import EXIT_OK, UserError


def _estimate_flags(p) -> None:
    """What the estimate needs beyond the job's shape (shared by render and cost)."""
    p.add_argument("--prices", metavar="FILE",
                   help="prices YAML (default: the one shipped with preftune)")
    p.add_argument("--hours", metavar="MIN[-MAX]", help="wall-clock hours of one iteration")
    p.add_argument("--tokens-per-second-per-gpu", metavar="MIN[-MAX]",
                   help="throughput, to estimate hours")
    p.add_argument("--metrics", metavar="METRICS_JSONL",
                   help="measure the throughput from a run's metrics")
    p.add_argument("--metrics-gpus", type=int, default=1,
                   help="GPUs of the run that wrote --metrics")
    p.add_argument("--epochs", type=float,
                   help="passes over the data (default: the config's max_steps)")
    p.add_argument("--samples", type=int, help="prompts or pairs in the data (default: counted)")
    p.add_argument("--tokens-per-sequence", type=int, help="default: the config's length limits")
    p.add_argument("--fsx-usd", metavar="MIN[-MAX]", help="FSx cost per iteration, fixed")
    p.add_argument("--fsx-gb", type=float, help="FSx size (priced per GB-month)")
    p.add_argument("--s3-usd", metavar="MIN[-MAX]", help="S3 cost per iteration, fixed")
    p.add_argument("--s3-gb", type=float, help="S3 checkpoint size (priced per GB-month)")
    p.add_argument("--storage-months", type=float, default=1.0,
                   help="months the storage is kept per iteration")
    p.add_argument("--iterations-per-year", type=int, default=1)


def add_parser(sub) -> None:
    render = sub.add_parser("render",
                            help="write the Kubernetes objects of a training job (deploy: section)")
    render.add_argument("config", help="YAML config file (the one the job trains with)")
    render.add_argument("overrides", nargs="*", default=[],
                        help="dotted KEY=VALUE overrides, e.g. deploy.nodes=2")
    render.add_argument("-o", "--output", help="folder for the YAML files (one per object)")
    render.add_argument("--check", action="store_true",
                        help="also validate every object against the Kubernetes and CRD schemas")
    render.add_argument("--crd-dir",
                        help="folder of CRD YAML files (kubectl get crd NAME -o yaml) for --check")
    _estimate_flags(render)
    _plan_flags(render)
    render.add_argument("--force", action="store_true",
                        help="render a job the plan says does not fit")
    render.set_defaults(handler=render_command, price_per_gpu_hour=None)

    cost = sub.add_parser("cost",
                          help="estimate what a training job costs (per iteration and per year)")
    cost.add_argument("config", nargs="?",
                      help="YAML config (nodes, GPUs, instance type, workload); optional")
    cost.add_argument("overrides", nargs="*", default=[],
                      help="dotted KEY=VALUE overrides, e.g. deploy.nodes=2")
    cost.add_argument("--nodes", type=int, help="default: deploy.nodes")
    cost.add_argument("--gpus-per-node", type=int, help="default: deploy.gpus_per_node")
    cost.add_argument("--instance-type", action="append", dest="instance_types", metavar="TYPE",
                      help="default: deploy.instance_types")
    cost.add_argument("--capacity-type", choices=CHOICES["deploy.capacity_type"],
                      help="default: deploy.capacity_type")
    cost.add_argument("--price-per-gpu-hour", metavar="MIN[-MAX]",
                      help="USD (default: from the prices file)")
    _estimate_flags(cost)
    cost.add_argument("--json", action="store_true", help="print the estimate as JSON")
    cost.set_defaults(handler=cost_command)

    plan = sub.add_parser(
        "plan", help="the memory a job needs per GPU and per host, its step time and cost"
    )
    plan.add_argument("config", help="YAML config (a job file for render, or any training config)")
    plan.add_argument("overrides", nargs="*", default=[], help="dotted KEY=VALUE overrides")
    plan.add_argument("--cpu", action="store_true",
                      help="plan a run on this machine's CPU (host memory only)")
    plan.add_argument("--nproc", type=int, default=1, help="with --cpu: processes (torchrun ranks)")
    plan.add_argument("--prices", metavar="FILE",
                      help="prices YAML (default: the one shipped with preftune)")
    _plan_flags(plan)
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(handler=plan_command)


def _plan_flags(p) -> None:
    p.add_argument("--model-config", metavar="PATH",
                   help="config.json (or its folder) when "
                   "model.name_or_path is not a local folder here")
    p.add_argument("--mfu", type=float, default=0.3,
                   help="model FLOPs utilisation for the step time (default 0.3)")
    p.add_argument("--gen-tokens-per-second-per-gpu", type=float, default=1000.0, dest="gen_tps",
                   help="generation throughput for the step time (default 1000)")


# ---------------------------------------------------------------- render


def render_command(args) -> int:
    if not args.output and not args.check:
        raise UserError("name an output folder with -o DIR (or pass --check to only validate)")
    cfg, data = _load(args.config, args.overrides)
    plan, notes = _render_plan(args, cfg)
    objects, more = render_objects(cfg, data, memory=plan["host"]["pod_memory"] if plan else None)
    notes += more
    d = cfg.deploy
    report = _estimate(args, cfg, d.nodes, d.gpus_per_node, d.instance_types, d.capacity_type)
    if args.check:
        problems, unchecked = schema_problems(objects, args.crd_dir)
        if problems:
            raise UserError(f"{len(problems)} schema problem(s); first: {problems[0]}")
        notes += unchecked
        print(f"checked {len(objects) - len(unchecked)} of "
              f"{len(objects)} objects against their schemas: ok")
    if args.output:
        write_objects(objects, Path(args.output))
        print(f"wrote {', '.join(objects)} to {args.output}")
        print(f"apply: kubectl apply -f {args.output}")
    for note in notes:
        print(f"note: {note}")
    print(_hourly(args, d) if report is None else "cost estimate:\n" + format_estimate(report))
    return EXIT_OK


def _hourly(args, d) -> str:
    """Without hours: what the job costs per hour, and how to get a total."""
    gpus = d.nodes * d.gpus_per_node
    try:
        price = cost.gpu_hour_price(cost.load_prices(args.prices),
                                    d.instance_types, d.capacity_type)
    except UserError as e:
        return f"cost: {gpus} GPUs; {e}"
    return (f"cost: {gpus} GPUs x ${cost.number(price)} per GPU-hour ({d.capacity_type}) = "
            f"{cost.money((gpus * price[0], gpus * price[1]))} per hour; add --hours or "
            "--tokens-per-second-per-gpu (or --metrics) for a total")


def _load(path, overrides):
    """The checked config, and the config as written (what the pods get)."""
    data = read_source(path)[0]
    for assignment in overrides:
        apply_override(data, assignment)
    return load_config(path, overrides), data


class _ManifestDumper(yaml.SafeDumper):
    """Plain YAML for kubectl and for reading: no anchors/aliases, multi-line strings as |
    blocks."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper, value: str):
    return dumper.represent_scalar("tag:yaml.org,2002:str", value,
                                   style="|" if "\n" in value else None)


_ManifestDumper.add_representer(str, _str)


def to_yaml(obj: dict) -> str:
    return yaml.dump(obj, Dumper=_ManifestDumper, sort_keys=False)


def write_objects(objects: dict[str, dict], out_dir: Path) -> None:
    """One YAML file per object; each written beside its target and renamed, so none is
    half-written."""
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError("exists and is not a folder", where=str(out_dir))
    try:
        for fname, obj in objects.items():
            atomic_write(out_dir / fname, to_yaml(obj))
    except OSError as e:
        raise UserError(f"cannot write: {e.strerror}", where=str(out_dir)) from None


def _render_plan(args, cfg) -> tuple[dict | None, list[str]]:
    """The job's plan; a job that does not fit is refused (78, the numbers in one block) unless
    --force."""
    path = args.model_config or cfg.model.name_or_path
    if not args.model_config and ("://" in path or not Path(path).exists()):
        return None, [f"no memory plan: model.name_or_path {path} is not a folder here (pass "
                      "--model-config CONFIG_JSON); the Pod requests deploy.memory "
                      f"({cfg.deploy.memory})"]
    plan = _plan(args, cfg)
    if plan["verdict"] == "does not fit" and not args.force:
        raise UserError("the job does not fit its node type (--force renders it anyway):\n"
                        + format_plan(plan))
    return plan, [f"plan: {plan['verdict']}; GPU peak {plan['gpu']['peak_gb']:.1f} of "
                  f"{plan['gpu']['capacity_gb']:.0f} GB, host peak {plan['host']['peak_gb']:.0f} "
                  "GB (`preftune plan` for the terms)"]


# ---------------------------------------------------------------- plan


def _plan(args, cfg, prices: dict | None = None) -> dict:
    for flag, value in (("--mfu", args.mfu), ("--gen-tokens-per-second-per-gpu", args.gen_tps)):
        if not value > 0 or (flag == "--mfu" and value > 1):
            raise UserError(f"must be in (0, {'1]' if flag == '--mfu' else 'inf)'}, got {value}",
                            where=flag)
    where = "--model-config" if args.model_config else "model.name_or_path"
    shape = planner.read_shape(args.model_config or cfg.model.name_or_path, where)
    d = cfg.deploy
    if getattr(args, "cpu", False):
        if args.nproc < 1:
            raise UserError(f"must be >= 1, got {args.nproc}", where="--nproc")
        target = planner.Target("this machine's CPU", 1, args.nproc, host_gb=_host_gb())
    else:
        node = instance_type(d.instance_types[0])
        if d.gpus_per_node > node.gpus:
            raise UserError(f"{d.gpus_per_node} GPUs per node, but "
                            f"{d.instance_types[0]} has {node.gpus}",
                            where="deploy.gpus_per_node")
        target = planner.Target(d.instance_types[0], d.nodes, d.gpus_per_node, node,
                                node.host_gb, d.capacity_type)
    if prices is None and getattr(args, "prices", None):
        prices = cost.load_prices(args.prices)
    return planner.make_plan(cfg, shape, target, mfu=args.mfu, gen_tps=args.gen_tps, prices=prices)


def _host_gb() -> float:
    """This machine's memory (MemTotal), GB."""
    try:
        with open("/proc/meminfo") as f:
            return next(
                int(line.split()[1]) * 1024 / 1e9 for line in f if line.startswith("MemTotal:")
            )
    except (OSError, StopIteration):
        return 0.0


def plan_command(args) -> int:
    cfg = _load(args.config, args.overrides)[0]
    plan = _plan(args, cfg)
    print(json.dumps(plan, indent=1) if args.json else format_plan(plan))
    return EXIT_OK


# ---------------------------------------------------------------- cost


def cost_command(args) -> int:
    cfg = _load(args.config, args.overrides)[0] if args.config else None
    if args.overrides and not args.config:
        raise UserError("KEY=VALUE overrides need a CONFIG")
    d = cfg.deploy if cfg else DeployConfig()
    nodes = args.nodes if args.nodes is not None else d.nodes
    gpus_per_node = args.gpus_per_node if args.gpus_per_node is not None else d.gpus_per_node
    report = _estimate(args, cfg, nodes, gpus_per_node, args.instance_types or d.instance_types,
                       args.capacity_type or d.capacity_type)
    if report is None:
        raise UserError("give --hours, or a throughput "
                        "(--tokens-per-second-per-gpu or --metrics) and a CONFIG")
    print(json.dumps(report, indent=1) if args.json else format_estimate(report))
    return EXIT_OK


def _estimate(args, cfg, nodes: int, gpus_per_node: int, instance_types: list[str],
              capacity: str) -> dict | None:
    """The cost report for a job of this shape, or None when nothing gives its hours."""
    for flag, value in (("--nodes", nodes), ("--gpus-per-node", gpus_per_node),
                        ("--iterations-per-year", args.iterations_per_year),
                        ("--metrics-gpus", args.metrics_gpus)):
        if value < 1:
            raise UserError(f"must be >= 1, got {value}", where=flag)
    if not (args.hours or args.tokens_per_second_per_gpu or args.metrics):
        return None
    prices = cost.load_prices(args.prices)
    price = (
        cost.parse_range(args.price_per_gpu_hour, "--price-per-gpu-hour")
        if args.price_per_gpu_hour
        else cost.gpu_hour_price(prices, instance_types, capacity)
    )
    hours, hours_from = _hours(args, cfg, nodes * gpus_per_node)
    storage = prices.get("storage") or {}
    fsx = cost.storage_usd(cost.parse_range(args.fsx_usd, "--fsx-usd") if args.fsx_usd else None,
                           args.fsx_gb, storage.get("fsx_gb_month_usd", 0.0), args.storage_months)
    s3 = cost.storage_usd(cost.parse_range(args.s3_usd, "--s3-usd") if args.s3_usd else None,
                          args.s3_gb, storage.get("s3_gb_month_usd", 0.0), args.storage_months)
    return cost.estimate(cost.CostInputs(nodes, gpus_per_node, capacity,
                                         list(instance_types), price, hours, fsx, s3,
                                         args.iterations_per_year, hours_from))


def _hours(args, cfg, gpus: int):
    if args.hours:
        return cost.parse_range(args.hours, "--hours"), {}
    if args.tokens_per_second_per_gpu:
        tps = cost.parse_range(args.tokens_per_second_per_gpu, "--tokens-per-second-per-gpu")
    else:
        tps = cost.measured_throughput(args.metrics, args.metrics_gpus)
    if cfg is None:
        raise UserError("estimating hours from a throughput needs the CONFIG (its workload)")
    work = cost.workload(cfg, epochs=args.epochs, samples=args.samples,
                         tokens_per_sequence=args.tokens_per_sequence)
    hours = cost.hours_from_throughput(work, tps, gpus)
    return hours, {"steps": work.steps, "sequences_per_step": work.sequences_per_step,
                   "tokens_per_sequence": work.tokens_per_sequence, "tokens": work.tokens,
                   "samples": work.samples, "epochs": work.epochs,
                   "tokens_per_second_per_gpu": list(tps)}
