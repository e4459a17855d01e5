"""The benchmark table: preftune vs TRL 1.16 over the shapes that matter, alternating frameworks.

Each row is one GRPO or DPO workload (bench_grpo.py / bench_dpo.py settings). For each row the two
frameworks run in fresh subprocesses, in alternating order over `rounds` (preftune first, then TRL
first, ...), their timed steps pooled; the table gives median s/step, completion tokens trained
per second, MFU (nominal FLOPs / s over the machine's measured matmul peak in the row's precision:
float32 on CPU, bf16 on a GPU; see workload.py), peak RSS (and on CUDA peak GPU memory), and
TRL / preftune ratios, with the load average around each run.

    python bench/suite.py                 # the full table (make bench)
    python bench/suite.py --size quick    # a small version (make bench BENCH=quick)
    python bench/suite.py --size gpu      # the 0.5B rows in bf16, for one GPU (bench/gpu.sh)
    python bench/suite.py --size gpu-vllm # the 0.5B rows with vLLM sampling, TRL in colocate mode
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
    ("grpo demo 16x16 T8 b0 it2", "grpo",
     "--prompts 16 --generations 16 --max-new-tokens 8 --num-iterations 2"),
    ("grpo 3M 8x4 T64 b.04", "grpo", "--model rand3m --reward digits --prompts 8 --generations 4 "
     "--max-new-tokens 64 --beta 0.04"),
    ("grpo 3M 4x8 T256 b.04", "grpo", "--model rand3m --reward digits --prompts 4 --generations 8 "
     "--max-new-tokens 256 --beta 0.04"),
    ("grpo 3M 8x8 T32 b.04 it2", "grpo",
     "--model rand3m --reward digits --prompts 8 --generations 8 --max-new-tokens "
     "32 --beta 0.04 --num-iterations 2"),
    ("grpo 3M P200 4x16 T16 b0", "grpo",
     "--model rand3m --reward digits --prompt-prefix 200 --prompts 4 "
     "--generations 16 --max-new-tokens 16"),
    ("grpo 3M P200 1x64 T16 b.04", "grpo",
     "--model rand3m --reward digits --prompt-prefix 200 --prompts 1 --generations 64 "
     "--max-new-tokens 16 --beta 0.04"),
    ("dpo demo traces B32", "dpo", "--batch 32"),
    ("dpo 3M short R8 B32", "dpo", "--model rand3m --response-len 8 --batch 32"),
    ("dpo 3M long R200 B16", "dpo", "--model rand3m --response-len 200 --batch 16"),
    ("dpo 3M P300 R16 B16", "dpo",
     "--model rand3m --prompt-prefix 300 --response-len 16 --batch 16"),
    ("dpo 3M V32k R64 B16", "dpo", "--model rand3m-v32k --response-len 64 --batch 16"),
]
QUICK = [
    ("grpo demo 8x8 T4 b0", "grpo", "--prompts 8 --generations 8 --max-new-tokens 4"),
    ("grpo 3M 2x4 T32 b.04", "grpo", "--model rand3m --reward digits --prompts 2 --generations 4 "
     "--max-new-tokens 32 --beta 0.04"),
    ("grpo 3M P100 2x8 T8 b0", "grpo",
     "--model rand3m --reward digits --prompt-prefix 100 --prompts 2 "
     "--generations 8 --max-new-tokens 8"),
    ("dpo 3M P100 R16 B8", "dpo", "--model rand3m --prompt-prefix 100 --response-len 16 --batch 8"),
]
# For one GPU (bench/gpu.sh): rand0.5b (a random-init Qwen2 of Qwen2.5-0.5B's shape) in bf16 mixed
# precision, 6 steps (2 warmup, so the it2 row times 2 generating + 2 reusing steps), 1 round.
# Time on one H200, both frameworks, estimated (not yet measured): every run pays a start-up of
# about 20-30 s (imports, CUDA context, loading 1 GB of bf16 weights into float32 masters, TRL's
# reference copy and dataset mapping); sampling is bound by per-token launch latency, ~15-30 ms per
# new token for 24 layers with HF generate (TRL) and less for preftune's sampler, while a 37k-token
# forward/backward takes ~0.4 s at ~300 TFLOP/s. So: T256 ~6 s/step TRL, ~4 s preftune -> ~105 s for
# the row; P512 T64 ~2 s/step (the 512-token prefix makes data.max_prompt_length 576 and every row
# 580 tokens long, ~0.4 s of forward/backward for TRL) -> ~60 s; it2 T128 (generation every other
# step) -> ~50 s; each DPO row is ~0.2-0.3 s/step, start-up bound -> ~45 s. With creating rand0.5b
# (~5 s), the two bf16 matmul peaks (~6 s) and the wheel install (~10 s): ~5.5 min, ~8 min if
# start-up and sampling are 1.5x the estimate, under the 560 s of the one device command. Rows run
# cheapest first and the JSON is rewritten after each row, so a run cut short still returns the rows
# it finished.
_05B = "--model rand0.5b --bf16"
GPU = [
    ("grpo 0.5B P512 4x16 T64 b0", "grpo",
     f"{_05B} --reward digits --prompt-prefix "
     "512 --prompts 4 --generations 16 --max-new-tokens 64"),
    ("dpo 0.5B R256 B16", "dpo", f"{_05B} --response-len 256 --batch 16"),
    ("dpo 0.5B P512 R64 B16", "dpo", f"{_05B} --prompt-prefix 512 --response-len 64 --batch 16"),
    ("grpo 0.5B 8x8 T128 b.04 it2", "grpo", f"{_05B} --reward digits --prompts 8 --generations 8 "
     "--max-new-tokens 128 --beta 0.04 --num-iterations 2"),
    ("grpo 0.5B 16x8 T256 b.04", "grpo",
     f"{_05B} --reward digits --prompts 16 --generations 8 --max-new-tokens 256 --beta 0.04"),
]
# Both frameworks sampling with vLLM beside training (preftune grpo.use_vllm, TRL
# vllm_mode=colocate), the engine on 0.3 of the GPU; bench/gpu.sh runs these after bench_vllm.py
# (VLLM=0 skips both).
GPU_VLLM = [
    ("grpo 0.5B 16x8 T256 b.04 vLLM", "grpo",
     f"{_05B} --vllm --reward digits --prompts 16 "
     "--generations 8 --max-new-tokens 256 --beta 0.04"),
    ("grpo 0.5B P512 4x16 T64 b0 vLLM", "grpo",
     f"{_05B} --vllm --reward digits --prompt-prefix 512 --prompts 4 --generations "
     "16 --max-new-tokens 64"),
]
# cases, steps, warmup, rounds
SIZES = {"full": (FULL, 8, 2, 2), "quick": (QUICK, 4, 1, 1), "gpu": (GPU, 6, 2, 1),
         "gpu-vllm": (GPU_VLLM, 6, 2, 1)}


def order(round_: int) -> tuple[str, ...]:
    """Alternate which framework runs first, so neither always gets the cooler machine."""
    return FRAMEWORKS if round_ % 2 == 0 else FRAMEWORKS[::-1]


def worker_argv(script: str, options: str, framework: str, out: str, steps: int, warmup: int,
                cache: str) -> list[str]:
    return [sys.executable, str(ROOT / "bench" / f"bench_{script}.py"),
            *options.split(), "--steps", str(steps),
            "--warmup", str(warmup), "--model-cache", cache, "--only", framework,
            "--json", out, "--worker"]


def run_case(script: str, options: str, steps: int, warmup: int, rounds: int, cache: str) -> dict:
    """{framework: pooled result} over `rounds` alternating runs, each in a fresh subprocess. A run
    that fails (out of memory, say) is recorded as failed and the suite goes on: one device command
    has to bring back every row it can."""
    runs: dict[str, list[dict]] = {f: [] for f in FRAMEWORKS}
    failed: dict[str, str] = {}
    for r in range(rounds):
        for fw in order(r):
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "r.json")
                load = os.getloadavg()[0]
                code = subprocess.run(worker_argv(script, options, fw, out, steps, warmup,
                                                  cache), cwd=ROOT).returncode
                if code:
                    failed[fw] = f"exit code {code}"
                    print(f"  {fw} failed with exit code {code}; its output is above", flush=True)
                    continue
                res = json.loads(Path(out).read_text())["results"][fw]
                res["load_avg"] = [load, os.getloadavg()[0]]
                runs[fw].append(res)
    return {fw: pool(rs) if rs else {"failed": failed[fw]} for fw, rs in runs.items()}


def pool(runs: list[dict]) -> dict:
    """One framework's runs of a row: step times pooled, throughput from the pooled median."""
    times = [t for r in runs for t in r["step_times"]]
    median = statistics.median(times)
    first = runs[0]
    tokens_per_step = first["completion_tokens_per_s"] * first["median_s"]
    phase_gflops = {
        k: statistics.fmean(r["phase_gflops"][k] for r in runs if k in r["phase_gflops"])
        for k in first["phase_gflops"]
    }
    return {
        "median_s": median,
        "steps": len(times),
        "completion_tokens_per_s": tokens_per_step / median,
        "flops_per_step": first["flops_per_step"],
        "peak_rss_mb": max(r["peak_rss_mb"] for r in runs),
        "phase_gflops": phase_gflops,
        "load_avg": [r["load_avg"] for r in runs],
        "rows_skipped_per_step": first.get("rows_skipped_per_step"),
        "precision": first.get("precision"),
        "peak_cuda_gib": max((r.get("peak_cuda_gib") or 0.0 for r in runs), default=0.0) or None,
        "push_s": statistics.median(r["push_s"] for r in runs) if "push_s" in first else None,
    }


def peak_name(key: tuple[str, str, int]) -> str:
    dtype, device, n = key
    return f"{dtype} {device} {n}"


def row_peak(options: str) -> str:
    """The matmul peak a row's MFU is taken against: its precision, on the device it runs on."""
    return peak_name(workload.peak_key("--bf16" in options.split()))


def measure_peaks(names: set[str]) -> dict[str, float]:
    """GFLOP/s for each "dtype device n"; the GPU memory it took is handed back to the workers."""
    import torch

    peaks = {name: workload.matmul_peak_gflops(int(name.split()[2]), dtype=name.split()[0],
                                               device=name.split()[1])
             for name in sorted(names)}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return peaks


def add_mfu(row: dict, peak_gflops: float) -> None:
    for r in row.values():
        if "failed" not in r:
            r["mfu"] = r["flops_per_step"] / r["median_s"] / (peak_gflops * 1e9)


def gpu_rows(rows: dict) -> bool:
    return any(r.get("peak_cuda_gib") for row in rows.values() for r in row.values())


def vllm_rows(rows: dict) -> bool:
    return any(r.get("push_s") for row in rows.values() for r in row.values())


def table_head(gpu: bool, vllm: bool = False) -> list[str]:
    gib = " GPU GiB preftune | GPU GiB TRL |" if gpu else ""
    push = " push s preftune | push s TRL |" if vllm else ""
    head = ("| workload | s/step preftune | s/step TRL | speed-up | tok/s "
            "preftune | tok/s TRL | MFU preftune | MFU TRL | RSS MB "
            f"preftune | RSS MB TRL | RSS ratio |{gib}{push} rows skipped |")
    return [head, "|" + "---|" * (head.count("|") - 1)]


def cell(x: dict, key: str, fmt: str) -> str:
    if "failed" in x:
        return "failed"
    return "-" if x.get(key) is None else format(x[key], fmt)


def row_line(name: str, r: dict, gpu: bool, vllm: bool = False) -> str:
    """One table row; a failed framework's cells read `failed`, and the ratios are left empty."""
    p, t = r["preftune"], r["trl"]
    both = "failed" not in p and "failed" not in t
    cols = [name, cell(p, "median_s", ".3f"), cell(t, "median_s", ".3f"),
            f"{t['median_s'] / p['median_s']:.2f}x" if both else "",
            cell(p, "completion_tokens_per_s", ".0f"), cell(t, "completion_tokens_per_s", ".0f"),
            cell(p, "mfu", ".0%"), cell(t, "mfu", ".0%"), cell(p, "peak_rss_mb", ".0f"),
            cell(t, "peak_rss_mb", ".0f"),
            f"{p['peak_rss_mb'] / t['peak_rss_mb']:.2f}" if both else ""]
    if gpu:
        cols += [cell(p, "peak_cuda_gib", ".1f"), cell(t, "peak_cuda_gib", ".1f")]
    if vllm:  # seconds to load the trained weights into the engine, median per generation batch
        cols += [cell(p, "push_s", ".3f"), cell(t, "push_s", ".3f")]
    skipped = p.get("rows_skipped_per_step")
    cols.append("" if skipped is None else f"{skipped:.1f}")
    return "| " + " | ".join(cols) + " |"


def table(rows: dict, peaks: dict[str, float], loads: tuple[float, float]) -> str:
    """Markdown: per row both frameworks' s/step, tokens/s, MFU, peak RSS (and on CUDA peak GPU
    memory), and TRL / preftune; under it the matmul peaks the MFU is taken against."""
    gpu, vllm = gpu_rows(rows), vllm_rows(rows)
    lines = table_head(gpu, vllm) + [row_line(name, r, gpu, vllm) for name, r in rows.items()]
    lines.append("")
    for name, gflops in peaks.items():
        lines.append(f"matmul peak {name} (dtype, device, n x n): {gflops:.1f} GFLOP/s (measured)")
    lines.append(f"load average {loads[0]:.2f} before, {loads[1]:.2f} after")
    return "\n".join(lines)


def phase_table(rows: dict) -> str:
    """Achieved nominal GFLOP/s per phase (sampling, reference/old passes, forward, backward)."""
    phases = ("sampling", "reference", "forward", "backward")
    lines = ["| workload | framework | " + " | ".join(phases) + " |",
             "|---|---|" + "---|" * len(phases)]
    for name, r in rows.items():
        for fw in FRAMEWORKS:
            g = r[fw].get("phase_gflops", {})
            lines.append(
                f"| {name} | {fw} | "
                + " | ".join(f"{g[k]:.1f}" if k in g else "-" for k in phases)
                + " |"
            )
    return "\n".join(lines)


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, list, int, int, int]:
    """The options, and the rows, steps, warmup and rounds they select."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="full")
    ap.add_argument("--steps", type=int, help="override the size's steps per run")
    ap.add_argument("--warmup", type=int, help="override the size's untimed first steps")
    ap.add_argument("--rounds", type=int, help="override the size's alternating rounds")
    ap.add_argument("--only", action="append",
                    help="run only rows whose name contains this (repeatable)")
    ap.add_argument("--json",
                    help="write every number (and the settings, load, peaks) here, after each row")
    ap.add_argument("--model-cache",
                    help="keep generated models here (default: a temporary folder)")
    args = ap.parse_args(argv)
    cases, steps, warmup, rounds = SIZES[args.size]
    steps, rounds = args.steps or steps, args.rounds or rounds
    warmup = warmup if args.warmup is None else args.warmup
    cases = [c for c in cases if not args.only or any(o in c[0] for o in args.only)]
    if not cases:
        ap.error(f"no row of --size {args.size} matches --only {args.only}")
    if warmup < 0 or steps <= warmup:
        ap.error(f"--steps ({steps}) must exceed --warmup ({warmup})")
    return args, cases, steps, warmup, rounds


def machine() -> dict:
    """Versions and the GPU, for the record (docs/benchmarks.md's tables name them)."""
    import importlib.metadata as md

    import torch

    info = {"python": sys.version.split()[0], "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
    for dist in ("transformers", "trl", "accelerate", "datasets"):
        try:
            info[dist] = md.version(dist)
        except md.PackageNotFoundError:
            info[dist] = None
    return info


def write(path: str | None, record: dict) -> None:
    """Replace the JSON whole: a run killed while writing leaves the previous rows readable."""
    if path:
        Path(path + ".tmp").write_text(json.dumps(record, indent=1))
        os.replace(path + ".tmp", path)


def main(argv: list[str] | None = None) -> dict:
    args, cases, steps, warmup, rounds = parse(argv)
    load_before = os.getloadavg()[0]
    peak_of = {name: row_peak(options) for name, _, options in cases}
    peaks = measure_peaks(set(peak_of.values()))  # again after the rows; the larger is used
    record = {"size": args.size, "steps": steps, "warmup": warmup, "rounds": rounds,
              "cpus": os.cpu_count(),
              "machine": machine(), "matmul_peaks": peaks, "row_peaks": peak_of,
              "load_avg": [load_before, None], "complete": False, "rows": {}}
    rows, gpu, t0 = record["rows"], workload.cuda_used(), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # generated models, shared by all runs of the suite
        cache = args.model_cache or tmp
        for name, script, options in cases:
            print(f"[{time.perf_counter() - t0:6.0f}s] {name}: {options}", flush=True)
            rows[name] = run_case(script, options, steps, warmup, rounds, cache)
            add_mfu(rows[name], peaks[peak_of[name]])
            print(row_line(name, rows[name], gpu, vllm_rows(rows)), flush=True)
            write(args.json, record)
    after = measure_peaks(set(peak_of.values()))
    record["matmul_peaks"] = peaks = {k: max(v, after[k]) for k, v in peaks.items()}
    for name, row in rows.items():
        add_mfu(row, peaks[peak_of[name]])
    record["load_avg"] = loads = (load_before, os.getloadavg()[0])
    record["complete"] = True
    command = "python bench/suite.py" + ("" if argv is None else " " + " ".join(argv))
    print(f"\n{command}: {steps} steps per run ({warmup} warmup), {rounds} alternating round(s), "
          f"{os.cpu_count()} CPUs, {time.perf_counter() - t0:.0f} s; {record['machine']}\n")
    print(table(rows, peaks, loads))
    print("\nachieved GFLOP/s by phase (nominal FLOPs / seconds in the phase, all steps)\n")
    print(phase_table(rows))
    write(args.json, record)
    return record


if __name__ == "__main__":
    done = main(sys.argv[1:])
    sys.exit(1 if any("failed" in r for row in done["rows"].values() for r in row.values()) else 0)
