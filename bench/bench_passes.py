"""Measurements behind the passes' choices, on one model (default rand3m) and this machine's CPU,
each alternating its variants:

- attention under a mask against the causal kernel, same rows (the packer's `logps.MASKED`);
- a log-prob pass with grad over groups of rows that share a prompt (`--group` rows each): plain
  rows against packed rows with each prompt once (`model/logps.py`);
- a rollout (`rollout.sampler.sample`) with the own module's steps in inference mode (now)
  against plain no-grad;
- forward+backward passes in a fresh process with glibc's defaults against `keep_freed_memory()`
  (`run/host_memory.py`): ms and minor page faults per pass, after warm-up passes.

    python bench/bench_passes.py                    # 32 rows x (20 prompt + 64 completion) tokens
    python bench/bench_passes.py --rows 8 --completion 8
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __package__:
    from bench import workload
else:  # run as a script: bench/ is on sys.path
    import workload


def median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def alternate(ways: dict, repeats: int, rounds: int) -> dict:
    """Median ms of each way, the ways taking turns `rounds` times; the best round's median per
    way."""
    best = {}
    for _ in range(rounds):
        for name, fn in ways.items():
            best[name] = min(best.get(name, float("inf")), median_ms(fn, repeats))
    return best


def batch(args):
    g = torch.Generator().manual_seed(0)
    B, P, T = args.rows, args.prompt, args.completion
    return (torch.randint(3, 250, (B, P), generator=g), torch.ones(B, P, dtype=torch.long),
            torch.randint(3, 250, (B, T), generator=g), torch.ones(B, T, dtype=torch.long))


def load(args):
    from preftune.config import ModelConfig
    from preftune.model.load import load_model

    return load_model(ModelConfig(), workload.model_dir(args.model, args.model_cache))


def masked_attention(model, args) -> dict:
    """One no-grad pass over the same rows: causal (no mask) against an explicit causal mask."""
    ids = torch.cat(batch(args)[0::2], 1)  # (B, P+T)
    pos = torch.arange(ids.size(1)).expand_as(ids)
    mask = (
        torch.ones(ids.size(1), ids.size(1), dtype=torch.bool)
        .tril()[None, None]
        .expand(ids.size(0), 1, -1, -1)
    )

    def run(masked: bool):
        with torch.no_grad():
            model(ids, pos, mask if masked else None)

    return alternate({"causal": lambda: run(False), "masked": lambda: run(True)},
                     args.repeats, args.rounds)


def layouts(model, args) -> dict:
    """Forward+backward of `completion_logps` on groups of `--group` rows sharing a prompt."""
    import preftune.model.logps as logps

    p_ids, p_mask, c_ids, c_mask = batch(args)
    p_ids = p_ids[::args.group].repeat_interleave(args.group, 0)  # (B, P): groups of equal prompts
    now = logps.MASKED

    def run(masked: float):
        logps.MASKED = masked
        lp, _ = logps.completion_logps(model, p_ids, p_mask, c_ids, c_mask)
        lp.sum().backward()
        model.zero_grad(set_to_none=True)

    try:
        return alternate({"plain rows": lambda: run(1e9), "packed, prompt once": lambda: run(0.0)},
                         args.repeats, args.rounds)
    finally:
        logps.MASKED = now


def rollout(model, args) -> dict:
    import preftune.rollout.sampler as sampler

    p_ids, p_mask = batch(args)[:2]
    groups = max(1, args.rows // 4)
    init = sampler._OwnDecoder.__init__

    def run(inference: bool):
        sampler._OwnDecoder.__init__ = lambda self, *a: (
            init(self, *a) or setattr(self, "inference", inference)
        )
        sampler.sample(model, p_ids[:groups], p_mask[:groups], num_generations=args.rows // groups,
                       max_new_tokens=args.completion, eos_id=-1, pad_id=0,
                       generator=torch.Generator().manual_seed(1))

    try:
        return alternate({"no_grad": lambda: run(False), "inference mode (now)": lambda: run(True)},
                         args.repeats, args.rounds)
    finally:
        sampler._OwnDecoder.__init__ = init


def faults_child(args) -> dict:
    """In this (fresh) process: ms and minor faults per forward+backward pass after warm-up."""
    from preftune.run.host_memory import keep_freed_memory
    from preftune.model.logps import completion_logps

    kept = keep_freed_memory() if args.child == "keep" else False
    model, tensors = load(args), batch(args)
    ms, faults = [], []
    for i in range(args.repeats + 3):
        f0, t0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
        logps, _ = completion_logps(model, *tensors)
        logps.sum().backward()
        if i >= 3:  # warm-up: the first passes fault in what every later one reuses
            ms.append(1e3 * (time.perf_counter() - t0))
            faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    return {"kept": kept, "ms": statistics.median(ms), "faults": statistics.median(faults)}


def page_faults(args, argv: list[str]) -> dict:
    from preftune.run.host_memory import user_chose

    env = {k: v for k, v in os.environ.items() if not user_chose({k: v})}
    out = {}
    for _ in range(args.rounds):
        for mode in ("default", "keep"):
            done = subprocess.run([sys.executable, __file__, *argv, "--child",
                                   mode], env=env, check=True,
                                  capture_output=True, text=True)
            r = json.loads(done.stdout.splitlines()[-1])
            if mode not in out or r["ms"] < out[mode]["ms"]:
                out[mode] = r
    return out


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="rand3m")
    ap.add_argument("--model-cache",
                    default=str(Path(tempfile.gettempdir()) / "preftune-bench-models"))
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt", type=int, default=20)
    ap.add_argument("--completion", type=int, default=64)
    ap.add_argument("--group", type=int, default=8, help="rows per shared prompt (the layouts row)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--child", choices=("default", "keep"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(faults_child(args)))
        return {}
    model = load(args)
    result = {"no-grad pass ms": masked_attention(model, args),
              "fwd+bwd pass ms": layouts(model, args), "rollout ms": rollout(model, args),
              "forward+backward": page_faults(args, argv)}
    print(f"{args.model}, {args.rows} rows x ({args.prompt} + "
          f"{args.completion}) tokens, {torch.get_num_threads()} threads, best "
          f"of {args.rounds} alternating rounds (median of {args.repeats})")
    for name, ways in result.items():
        print(f"  {name}: " + ", ".join(f"{k} "
                                        f"{json.dumps(v) if isinstance(v, dict) else f'{v:.1f}'}"
                                        for k, v in ways.items()))
    return result


if __name__ == "__main__":
    main()
