"""The benchmark table: preftune vs TRL 1.16 over the shapes that matter, alternating frameworks.

Each row is one GRPO or DPO workload (bench_grpo.py / bench_dpo.py settings). For each row the two
frameworks run in fresh subprocesses, in alternating order over `rounds` (preftune first, then TRL
first, ...), their timed steps pooled; the table gives median s/step, completion tokens trained
per second, MFU (nominal FLOPs / s over the machine's measured float32 matmul peak, see
workload.py), peak RSS, and TRL / preftune ratios, with the load average around each run.

    python bench/suite.py                 # the full table (make bench)
    python bench/suite.py --size quick    # a small version (make bench BENCH=quick)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__:
    from bench import workload
else:  # run as a script: bench/ is on sys.path
    import workload

ROOT = workload.ROOT
FRAMEWORKS = ("preftune", "trl")

# (name, script, options). GRPO: --prompts P --generations G --max-new-tokens T; DPO: --batch B.
FULL = [
    ("grpo demo 16x16 T4 b0", "grpo", "--prompts 16 --generations 16 --max-new-tokens 4"),
    ("grpo demo 16x8 T8 b0", "grpo", "--prompts 16 --generations 8 --max-new-tokens 8"),
    ("grpo demo 16x16 T8 b0 it2", "grpo", "--prompts 16 --generations 16 --max-new-tokens 8 --num-iterations 2"),
    ("grpo 3M 8x4 T64 b.04", "grpo", "--model rand3m --reward digits --prompts 8 --generations 4 "
                                     "--max-new-tokens 64 --beta 0.04"),
    ("grpo 3M 4x8 T256 b.04", "grpo", "--model rand3m --reward digits --prompts 4 --generations 8 "
                                      "--max-new-tokens 256 --beta 0.04"),
    ("grpo 3M 8x8 T32 b.04 it2", "grpo", "--model rand3m --reward digits --prompts 8 --generations 8 "
                                         "--max-new-tokens 32 --beta 0.04 --num-iterations 2"),
    ("grpo 3M P200 4x16 T16 b0", "grpo", "--model rand3m --reward digits --prompt-prefix 200 --prompts 4 "
                                         "--generations 16 --max-new-tokens 16"),
    ("grpo 3M P200 1x64 T16 b.04", "grpo", "--model rand3m --reward digits --prompt-prefix 200 --prompts 1 "
                                           "--generations 64 --max-new-tokens 16 --beta 0.04"),
    ("dpo demo traces B32", "dpo", "--batch 32"),
    ("dpo 3M short R8 B32", "dpo", "--model rand3m --response-len 8 --batch 32"),
    ("dpo 3M long R200 B16", "dpo", "--model rand3m --response-len 200 --batch 16"),
    ("dpo 3M P300 R16 B16", "dpo", "--model rand3m --prompt-prefix 300 --response-len 16 --batch 16"),
    ("dpo 3M V32k R64 B16", "dpo", "--model rand3m-v32k --response-len 64 --batch 16"),
]
QUICK = [
    ("grpo demo 8x8 T4 b0", "grpo", "--prompts 8 --generations 8 --max-new-tokens 4"),
    ("grpo 3M 2x4 T32 b.04", "grpo", "--model rand3m --reward digits --prompts 2 --generations 4 "
                                     "--max-new-tokens 32 --beta 0.04"),
    ("grpo 3M P100 2x8 T8 b0", "grpo", "--model rand3m --reward digits --prompt-prefix 100 --prompts 2 "
                                       "--generations 8 --max-new-tokens 8"),
    ("dpo 3M P100 R16 B8", "dpo", "--model rand3m --prompt-prefix 100 --response-len 16 --batch 8"),
]
SIZES = {"full": (FULL, 8, 2, 2), "quick": (QUICK, 4, 1, 1)}  # cases, steps, warmup, rounds


def order(round_: int) -> tuple[str, ...]:
    """Alternate which framework runs first, so neither always gets the cooler machine."""
    return FRAMEWORKS if round_ % 2 == 0 else FRAMEWORKS[::-1]


def worker_argv(script: str, options: str, framework: str, out: str, steps: int, warmup: int, cache: str) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / f"bench_{script}.py"), *options.split(), "--steps", str(steps),
            "--warmup", str(warmup), "--model-cache", cache, "--only", framework, "--json", out, "--worker"]


def run_case(script: str, options: str, steps: int, warmup: int, rounds: int, cache: str) -> dict:
    """{framework: pooled result} over `rounds` alternating runs, each in a fresh subprocess."""
    runs: dict[str, list[dict]] = {f: [] for f in FRAMEWORKS}
    for r in range(rounds):
        for fw in order(r):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "r.json")
                load = os.getloadavg()[0]
                subprocess.run(worker_argv(script, options, fw, out, steps, warmup, cache), check=True, cwd=ROOT)
                res = json.loads(Path(out).read_text())["results"][fw]
                res["load_avg"] = [load, os.getloadavg()[0]]
                runs[fw].append(res)
    return {fw: pool(rs) for fw, rs in runs.items()}


def pool(runs: list[dict]) -> dict:
    """One framework's runs of a row: step times pooled, throughput from the pooled median."""
    times = [t for r in runs for t in r["step_times"]]
    median = statistics.median(times)
    first = runs[0]
    tokens_per_step = first["completion_tokens_per_s"] * first["median_s"]
    phase_gflops = {k: statistics.fmean(r["phase_gflops"][k] for r in runs if k in r["phase_gflops"])
                    for k in first["phase_gflops"]}
    return {"median_s": median, "steps": len(times), "completion_tokens_per_s": tokens_per_step / median,
            "flops_per_step": first["flops_per_step"], "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
            "phase_gflops": phase_gflops, "load_avg": [r["load_avg"] for r in runs],
            "rows_skipped_per_step": first.get("rows_skipped_per_step")}


def add_mfu(row: dict, peak_gflops: float) -> None:
    for r in row.values():
        r["mfu"] = r["flops_per_step"] / r["median_s"] / (peak_gflops * 1e9)


def table(rows: dict, peak: float, loads: tuple[float, float]) -> str:
    """Markdown: per row both frameworks' s/step, tokens/s, MFU, peak RSS, and TRL / preftune."""
    head = ("| workload | s/step preftune | s/step TRL | speed-up | tok/s preftune | tok/s TRL | MFU preftune | "
            "MFU TRL | RSS MB preftune | RSS MB TRL | RSS ratio | rows skipped |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in rows.items():
        p, t = r["preftune"], r["trl"]
        skipped = p.get("rows_skipped_per_step")
        lines.append(
            f"| {name} | {p['median_s']:.3f} | {t['median_s']:.3f} | {t['median_s'] / p['median_s']:.2f}x | "
            f"{p['completion_tokens_per_s']:.0f} | {t['completion_tokens_per_s']:.0f} | {p['mfu']:.0%} | "
            f"{t['mfu']:.0%} | {p['peak_rss_mb']:.0f} | {t['peak_rss_mb']:.0f} | "
            f"{p['peak_rss_mb'] / t['peak_rss_mb']:.2f} | {'' if skipped is None else f'{skipped:.1f}'} |")
    lines.append("")
    lines.append(f"float32 matmul peak {peak:.1f} GFLOP/s (measured); load average {loads[0]:.2f} before, "
                 f"{loads[1]:.2f} after")
    return "\n".join(lines)


def phase_table(rows: dict) -> str:
    """Achieved nominal GFLOP/s per phase (sampling, reference/old passes, forward, backward)."""
    phases = ("sampling", "reference", "forward", "backward")
    lines = ["| workload | framework | " + " | ".join(phases) + " |", "|---|---|" + "---|" * len(phases)]
    for name, r in rows.items():
        for fw in FRAMEWORKS:
            g = r[fw]["phase_gflops"]
            lines.append(f"| {name} | {fw} | " + " | ".join(f"{g[k]:.1f}" if k in g else "-" for k in phases) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--steps", type=int, help="override the size's steps per run")
    ap.add_argument("--rounds", type=int, help="override the size's alternating rounds")
    ap.add_argument("--only", action="append", help="run only rows whose name contains this (repeatable)")
    ap.add_argument("--json", help="write every number (and the settings, load, peak) here")
    args = ap.parse_args(argv)
    cases, steps, warmup, rounds = SIZES[args.size]
    steps, rounds = args.steps or steps, args.rounds or rounds
    cases = [c for c in cases if not args.only or any(o in c[0] for o in args.only)]
    load_before = os.getloadavg()[0]
    peak = workload.matmul_peak_gflops()
    rows: dict[str, dict] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as cache:  # generated models, shared by all runs of the suite
        for name, script, options in cases:
            print(f"[{time.perf_counter() - t0:6.0f}s] {name}: {options}", flush=True)
            rows[name] = run_case(script, options, steps, warmup, rounds, cache)
    peak = max(peak, workload.matmul_peak_gflops())
    for r in rows.values():
        add_mfu(r, peak)
    loads = (load_before, os.getloadavg()[0])
    command = "python bench/suite.py" + ("" if argv is None else " " + " ".join(argv))
    print(f"\n{command}: {steps} steps per run ({warmup} warmup), {rounds} alternating round(s), "
          f"{os.cpu_count()} CPUs\n")
    print(table(rows, peak, loads))
    print("\nachieved GFLOP/s by phase (nominal FLOPs / seconds in the phase, all steps)\n")
    print(phase_table(rows))
    record = {"size": args.size, "steps": steps, "warmup": warmup, "rounds": rounds, "cpus": os.cpu_count(),
              "matmul_peak_gflops": peak, "load_avg": loads, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    main(sys.argv[1:])
