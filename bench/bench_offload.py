"""FSDP2 with and without CPU offload (`distributed.cpu_offload`) on two torchrun ranks (gloo, one
thread each), on bench_ranks.py's workloads (GRPO with a reference, DPO, SFT with packing, rand3m).

The two variants run alternately, `--rounds` times each (which goes first swaps every round); a
variant's step times after --warmup are pooled and its median printed with the machine's load
average before and after each run. On CPU ranks the policy's copies to host memory are no-ops
(the shards already live there) and AdamW steps on the CPU either way, so what this measures is
the policy's own bookkeeping. On a GPU the offload's cost is the copies over PCIe each way and
AdamW stepping on the host: measure that with this script's command on GPU nodes.

    python bench/bench_offload.py --json bench-offload.json   # make bench runs it
    python bench/bench_offload.py --only sft --steps 4 --rounds 1
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

if __package__:
    from bench import bench_ranks, workload
else:  # run as a script: bench/ is on sys.path
    import bench_ranks
    import workload

VARIANTS = {"fsdp": False, "fsdp + cpu_offload": True}


def measure(build, args) -> dict:
    """Each variant's pooled step times over the rounds, and offload's median over plain's."""
    times: dict = {v: [] for v in VARIANTS}
    loads: dict = {v: [] for v in VARIANTS}
    with tempfile.TemporaryDirectory() as tmp:
        model = workload.model_dir(args.model, args.model_cache or tmp)
        argv = build(Path(tmp), model, args.steps)
        for r in range(args.rounds):
            # the machine drifts: alternate which variant runs first
            for variant in (VARIANTS if r % 2 == 0 else reversed(VARIANTS)):
                offload = VARIANTS[variant]
                before = os.getloadavg()[0]
                times[variant] += bench_ranks.run(
                    argv, 2, True, Path(tmp), model, args.steps, port=args.port + offload,
                    extra=[f"distributed.cpu_offload={str(offload).lower()}"])[args.warmup:]
                loads[variant].append([round(before, 2), round(os.getloadavg()[0], 2)])
    out = {v: {"median_s": statistics.median(times[v]), "steps": len(times[v]),
               "load_avg": loads[v]} for v in VARIANTS}
    out["offload / plain"] = out["fsdp + cpu_offload"]["median_s"] / out["fsdp"]["median_s"]
    return out


def table(rows: dict) -> str:
    lines = ["| workload | fsdp s/step | fsdp + cpu_offload s/step | offload / plain | "
             "load average (before, after each run) |", "|---|---|---|---|---|"]
    for name, r in rows.items():
        loads = ", ".join(f"{a:.1f}-{b:.1f}" for v in VARIANTS for a, b in r[v]["load_avg"])
        lines.append(f"| {name} | {r['fsdp']['median_s']:.3f} | "
                     f"{r['fsdp + cpu_offload']['median_s']:.3f} | {r['offload / plain']:.3f}x | "
                     f"{loads} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload.run_args(ap, "rand3m")
    ap.add_argument("--rounds", type=int, default=2, help="runs of each variant, alternating")
    ap.add_argument("--port", type=int, default=29620, help="torchrun's port (and the next one)")
    args = ap.parse_args(argv)
    title = f"python bench/bench_offload.py {' '.join(argv or sys.argv[1:])}, model {args.model}"
    return workload.run_workloads(bench_ranks.WORKLOADS,
                                  lambda name: measure(bench_ranks.WORKLOADS[name], args),
                                  args, title, table)


if __name__ == "__main__":
    main()
