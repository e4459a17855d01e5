"""`preftune eval CONFIG --checkpoint PATH [--baseline PATH] [KEY=VALUE ...]` and `preftune registry
list`.

eval: exit 0 when the checkpoint passes the gate, 3 when it fails (1 stays a crash), 78 on a config
or data error; eval.json (every figure, the thresholds, the verdict and its reason) is written into
the checkpoint folder, and a pass appends a record to `gate.registry` when one is set.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
from datetime import datetime, timezone
from pathlib import Path

from preftune.atomic import atomic_write
from preftune.data.tokenize import PromptTruncation
from preftune.errors import EXIT_GATE_FAILED, EXIT_OK, UserError
from preftune.evaluation.registry import append, format_table, read
from preftune.run.preemption import process_handler
import preftune

EVAL_FILE = "eval.json"
log = logging.getLogger("preftune")


def add_parser(sub) -> None:
    ev = sub.add_parser("eval",
                        help="evaluate a checkpoint on held-out "
                        "prompts and gate it against a baseline")
    ev.add_argument("config",
                    help="YAML config (data.eval or eval.split, reward functions, gate thresholds)")
    ev.add_argument("--checkpoint", required=True,
                    help="model folder to evaluate (final/ or checkpoints/step-N/)")
    ev.add_argument("--baseline", default=None,
                    help="model folder to compare with (e.g. the one in production)")
    ev.add_argument("overrides", nargs="*", default=[],
                    help="dotted KEY=VALUE overrides, e.g. gate.min_reward=0.5")
    ev.set_defaults(handler=run_eval)
    reg = sub.add_parser("registry", help="the model registry that passing gates append to")
    rsub = reg.add_subparsers(dest="registry_command", required=True)
    ls = rsub.add_parser("list", help="list the registry's records, oldest first")
    ls.add_argument("--registry", default=None,
                    help="registry path or URL (default: gate.registry of --config, "
                    "else $PREFTUNE_REGISTRY)")
    ls.add_argument("--config", default=None, help="a config whose gate.registry to list")
    ls.add_argument("--json", action="store_true", help="print the records as JSON lines")
    ls.set_defaults(handler=run_registry_list)


def _load(cfg, path: str, device):
    from preftune.model.load import load_model, load_tokenizer

    if not Path(path).is_dir():
        raise UserError("no such model folder", where=path)
    # a saved checkpoint has LoRA merged
    no_lora = dataclasses.replace(cfg.model.lora, enabled=False)
    model_cfg = dataclasses.replace(cfg.model, name_or_path=path, lora=no_lora)
    tok = load_tokenizer(path, cfg.model.trust_remote_code)
    return load_model(model_cfg, path, trainable=False).to(device), tok


def _device():
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def evaluate_model(cfg, path: str, prompt_set, funcs, weights) -> tuple[dict, "object"]:
    """Summary figures and the greedy per-prompt result of one model folder (same prompts, same
    seeds)."""
    import torch

    from preftune.evaluation.evaluate import generate_scored, summarize, with_environment_reward
    from preftune.rollout.agent import build_agent
    from preftune.rollout.engine import make_engine

    device = _device()
    model, tok = _load(cfg, path, device)
    common = dict(weights=weights,
                  max_new_tokens=cfg.eval.max_new_tokens or cfg.grpo.max_completion_length,
                  batch_size=cfg.eval.batch_size,
                  truncation=PromptTruncation(cfg.data.max_prompt_length, "left"))
    # vLLM: an engine on this folder's weights (no push needed); seeds from the run's seed
    common |= {"engine": make_engine(cfg, None, model_path=path), "seed": cfg.seed}
    # held-out tasks run through the configured tools and environment (any algorithm: an agent
    # trained by SFT is evaluated as it will act), scored by its get_reward too
    common["agent"] = build_agent(cfg.grpo, tok, cfg.config_dir)
    funcs, common["weights"] = with_environment_reward(funcs, weights, common["agent"])
    greedy = generate_scored(model, tok, prompt_set, funcs, **common)
    figures = summarize(greedy, prefix="")
    k = cfg.eval.num_samples
    if k > 1:  # the training sampling settings; the same seed for every model evaluated
        g = cfg.grpo
        generator = torch.Generator(device).manual_seed(cfg.seed)
        sampled = generate_scored(model, tok, prompt_set, funcs, num_samples=k, generator=generator,
                                  sampling={"temperature": g.temperature, "top_p": g.top_p,
                                            "top_k": g.top_k}, **common)
        figures |= {
            k_: v
            for k_, v in summarize(sampled, prefix="sampled/").items()
            if k_ != "sampled/num_prompts"
        }
    return figures, greedy


def run_eval(args) -> int:
    from preftune.config import load_config, to_dict
    from preftune.evaluation.gate import check_gate, decide
    from preftune.evaluation.pairs import is_pairs_file

    cfg = load_config(args.config, args.overrides)
    stop = process_handler()
    # from here a signal stops the evaluation (exit 75) with a line that says so
    if stop is not None:
        stop.setup(cfg.preemption_grace_seconds, "evaluation", f"{EVAL_FILE} was not written")
    pairs = is_pairs_file(cfg.data.eval)
    check_gate(cfg.gate, args.baseline is not None, pairs)
    ckpt, base, comparison, held_out = (pairs_eval if pairs else prompts_eval)(cfg, args)
    verdict = decide(cfg.gate, ckpt, comparison)
    report = {"checkpoint": os.path.abspath(args.checkpoint),
              "baseline": os.path.abspath(args.baseline) if args.baseline else None,
              **held_out, "num_samples": cfg.eval.num_samples, "seed": cfg.seed,
              "metrics": {"checkpoint": ckpt, "baseline": base}, "comparison": comparison,
              "gate": to_dict(cfg.gate), "checks": verdict.checks,
              "verdict": "pass" if verdict.passed else "fail", "reason": verdict.reason}
    out = _write_json(Path(args.checkpoint) / EVAL_FILE, report)
    print(format_eval(report))
    print(f"eval.json: {out}")
    if verdict.passed and cfg.gate.registry:
        where = append(cfg.gate.registry, registry_record(cfg, args.checkpoint, report))
        print(f"registry: appended to {where}")
    return EXIT_OK if verdict.passed else EXIT_GATE_FAILED


def prompts_eval(cfg, args) -> tuple[dict, dict | None, dict | None, dict]:
    """Figures of the checkpoint (and baseline) on held-out prompts, and their paired comparison."""
    from preftune.evaluation.evaluate import eval_prompt_set, eval_reward_funcs
    from preftune.evaluation.gate import compare

    prompt_set = eval_prompt_set(cfg)
    if prompt_set is None:
        raise UserError("no held-out prompts: set data.eval, or "
                        "eval.split to hold out part of data.train",
                        where="data.eval")
    funcs, weights = eval_reward_funcs(cfg, _device())
    ckpt, ckpt_greedy = evaluate_model(cfg, args.checkpoint, prompt_set, funcs, weights)
    base = comparison = None
    if args.baseline:
        base, base_greedy = evaluate_model(cfg, args.baseline, prompt_set, funcs, weights)
        comparison = compare(ckpt_greedy.total[:, 0], base_greedy.total[:, 0], cfg.gate, cfg.seed,
                             ckpt["completions/mean_length"], base["completions/mean_length"])
    return ckpt, base, comparison, {"prompts": len(prompt_set)}


def pairs_eval(cfg, args) -> tuple[dict, dict | None, dict | None, dict]:
    """TRL's DPO metrics of the checkpoint (and baseline) on the held-out pairs of data.eval, and
    their paired comparison by pair (ranked right or not)."""
    from preftune.evaluation.gate import compare
    from preftune.evaluation.pairs import pair_figures

    paths = [args.checkpoint] + ([args.baseline] if args.baseline else [])
    figures = pair_figures(cfg, paths, _load, _device())
    (ckpt, ckpt_right), base, comparison = figures[0], None, None
    if args.baseline:
        base, base_right = figures[1]
        comparison = compare(ckpt_right, base_right, cfg.gate, cfg.seed, series="pair accuracy")
    return ckpt, base, comparison, {"pairs": ckpt["num_pairs"]}


def registry_record(cfg, checkpoint: str, report: dict) -> dict:
    from preftune.evaluation.gate import data_fingerprint

    metrics = dict(report["metrics"]["checkpoint"])
    if report["comparison"]:
        metrics |= {k: report["comparison"][k] for k in ("improvement",
                                                         "improvement_lower", "length_growth")}
    return {"model_path": os.path.abspath(checkpoint), "metrics": json_safe(metrics),
            "verdict": report["verdict"],
            "reason": report["reason"], "config_hash": _config_hash(cfg, Path(checkpoint)),
            "data_fingerprint": data_fingerprint(cfg.data.train),
            "base_model": cfg.model.name_or_path,
            "baseline": report["baseline"], "preftune_version": preftune.__version__,
            "time": datetime.now(timezone.utc).isoformat(timespec="microseconds")}


def _config_hash(cfg, checkpoint: Path) -> str:
    """sha256 of the training config: the checkpoint's own copy (step-N/preftune.yaml, or the run's
    config.yaml beside final/), else the config given to eval."""
    from preftune.run.resume import CONFIG_FILE, checkpoint_config

    for f in (checkpoint / CONFIG_FILE, checkpoint.parent / "config.yaml"):
        if f.is_file():
            return hashlib.sha256(f.read_bytes()).hexdigest()
    return hashlib.sha256(checkpoint_config(cfg).encode()).hexdigest()


def json_safe(x):
    """NaN and infinities become null (JSON has neither), recursively."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: json_safe(v) for k, v in x.items()}
    if isinstance(x, list):
        return [json_safe(v) for v in x]
    return x


def _write_json(path: Path, data: dict) -> Path:
    atomic_write(path, json.dumps(json_safe(data), indent=1, allow_nan=False) + "\n")
    return path


def format_eval(report: dict) -> str:
    ckpt, base = report["metrics"]["checkpoint"], report["metrics"]["baseline"]
    keys = [k for k in ckpt if k not in ("num_prompts", "num_pairs")]
    lines = [
        f"{'':<34}{'checkpoint':>12}{'baseline':>12}" if base else f"{'':<34}{'checkpoint':>12}"
    ]
    for k in keys:
        row = f"{k:<34}{_fmt(ckpt[k]):>12}"
        lines.append(row + (f"{_fmt(base.get(k)):>12}" if base else ""))
    c = report["comparison"]
    if c:
        pairs = c["series"] == "pair accuracy"
        growth = "" if c["length_growth"] is None else f"  length growth {c['length_growth']:.3f}x"
        lines.append(f"{'pair accuracy ' if pairs else ''}improvement {c['improvement']:+.4f}  "
                     f"({c['confidence']:.0%} bounds {c['improvement_lower']:+.4f} .. "
                     f"{c['improvement_upper']:+.4f}, {c['paired_prompts']} "
                     f"{'pairs' if pairs else 'prompts'}){growth}")
    lines.append(f"verdict: {report['verdict'].upper()} ({report['reason']})")
    return "\n".join(lines)


def _fmt(x) -> str:
    return f"{x:.4f}" if isinstance(x, float) else str(x if x is not None else "-")


def run_registry_list(args) -> int:
    url = args.registry
    if url is None and args.config:
        from preftune.config import load_config

        url = load_config(args.config).gate.registry
    url = url or os.environ.get("PREFTUNE_REGISTRY")
    if not url:
        raise UserError("which registry? pass --registry URL or --config CONFIG (with "
                        "gate.registry), or set PREFTUNE_REGISTRY", where="registry list")
    records = read(url)
    print(
        "\n".join(json.dumps(r, sort_keys=True) for r in records)
        if args.json
        else format_table(records)
    )
    return EXIT_OK
