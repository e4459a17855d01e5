"""Two torchrun ranks (gloo, FSDP2) against one process, on the same global batch, and preftune's
own module against the Hugging Face module (`model.lean_forward: false`) on the same two ranks:

- GRPO, ~200-token prompts shared by G = 16 completions, beta 0.04 (rand3m);
- DPO, a 300-token prompt shared by chosen and rejected (rand3m);
- SFT with packing, examples of uneven lengths (rand3m).

Each variant is a fresh `preftune train` (two ranks: `torchrun --nproc-per-node 2`, one thread
each; one process: two threads), its median step_time over the steps after --warmup. The goals
(issue 21): two ranks with the own module at least 2.5x faster than with the Hugging Face module,
and at most 2x the one-process step.

    python bench/bench_ranks.py --json bench-ranks.json      # make bench runs it after the suite
    python bench/bench_ranks.py --only grpo --steps 4
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__:
    from bench import bench_dpo, workload
else:  # run as a script: bench/ is on sys.path
    import bench_dpo
    import workload

ROOT = workload.ROOT
VARIANTS = {"1 process": (1, True), "2 ranks": (2, True), "2 ranks, HF module": (2, False)}


def grpo(tmp: Path, model: Path, steps: int) -> list[str]:
    rows = workload.prompt_rows(200)
    train = tmp / "prompts.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [
        str(ROOT / "examples" / "grpo.yaml"),
        f"model.name_or_path={model}",
        f"data.train={train}",
        "data.max_prompt_length=264",
        "data.eval=null",
        "grpo.prompts_per_step=4",
        "grpo.num_generations=16",
        "grpo.micro_batch_size=32",
        "grpo.max_completion_length=16",
        "grpo.beta=0.04",
        f"grpo.reward_funcs=[{ROOT / 'bench' / 'workload.py'}:digit_fraction]",
        f"max_steps={steps}",
    ]


def dpo(tmp: Path, model: Path, steps: int) -> list[str]:
    path, _ = bench_dpo.dpo_data(Path("/nonexistent"), str(tmp), prefix=300, response=16)
    return [str(ROOT / "examples" / "dpo.yaml"),
            f"model.name_or_path={model}", f"data.train={path}",
            "data.eval=null", "data.max_prompt_length=364",
            "dpo.max_length=400", "dpo.batch_size=16",
            "dpo.micro_batch_size=8", f"max_steps={steps}"]


def sft(tmp: Path, model: Path, steps: int) -> list[str]:
    filler = workload.FILLER * 4  # 176 characters, so the slices below give uneven lengths
    rows = [{"prompt": r["input"] + filler[:(i * 37) % 160],
             "completion": r["answer"] + filler[:(i * 53) % 120]}
            for i, r in enumerate(workload.prompt_rows(0)[:256])]
    train = tmp / "sft.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [str(ROOT / "examples" / "sft.yaml"),
            f"model.name_or_path={model}", f"data.train={train}",
            "data.eval=null", "data.max_prompt_length=256",
            "sft.max_length=400", "sft.batch_size=32",
            "sft.micro_batch_size=16", "sft.packing=true", f"max_steps={steps}"]


WORKLOADS = {"grpo P200 G16 b.04": grpo, "dpo P300 R16 B16": dpo, "sft packing B32": sft}


def run(args_of, ranks: int, own: bool, tmp: Path, model: Path, steps: int,
        port: int | None = None, extra: list[str] = ()) -> list[float]:
    """One `preftune train` (`extra`: more overrides; `port`: torchrun's, so that runs of other
    scripts need not share one); the step times it logged."""
    out = tmp / f"run-{ranks}-{own}"
    argv = [*args_of, f"output_dir={out}", "save_steps=0", "resume=never",
            "overwrite_output_dir=true",
            "log.progress_bar=false", "eval.eval_steps=0", f"model.lean_forward={str(own).lower()}",
            *extra]
    env = dict(os.environ, PYTHONPATH=str(ROOT),
               OMP_NUM_THREADS="1" if ranks > 1 else str(os.cpu_count() or 1))
    if ranks > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
               str(ranks), "--master-port",
               str(port or 29500 + ranks + 10 * own), "-m", "preftune.cli", "train", *argv]
    else:
        cmd = [sys.executable, "-m", "preftune.cli", "train", *argv]
    done = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd[:6])}... exited "
                           f"{done.returncode}:\n{done.stderr[-2000:]}")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["step_time"] for r in records if "step_time" in r]


def measure(name: str, build, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        model = workload.model_dir(args.model, args.model_cache or tmp)
        argv = build(Path(tmp), model, args.steps)
        out = {}
        for variant, (ranks, own) in VARIANTS.items():
            load = os.getloadavg()[0]
            times = run(argv, ranks, own, Path(tmp), model, args.steps)[args.warmup:]
            out[variant] = {"median_s": statistics.median(times), "steps": len(times),
                            "load_avg": [load, os.getloadavg()[0]]}
    own2, hf2, one = (out[v]["median_s"] for v in ("2 ranks", "2 ranks, HF module", "1 process"))
    out["own vs HF module (2 ranks)"] = hf2 / own2
    out["2 ranks vs 1 process"] = own2 / one
    return out


def table(rows: dict) -> str:
    lines = ["| workload | 1 process s/step | 2 ranks s/step | 2 ranks HF module s/step | own vs "
             "HF (goal >= 2.5x) | 2 ranks / 1 process (goal <= 2x) |", "|---|---|---|---|---|---|"]
    for name, r in rows.items():
        lines.append(f"| {name} | {r['1 process']['median_s']:.3f} | "
                     f"{r['2 ranks']['median_s']:.3f} | {r['2 ranks, HF module']['median_s']:.3f} "
                     f"| {r['own vs HF module (2 ranks)']:.2f}x | "
                     f"{r['2 ranks vs 1 process']:.2f}x |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload.run_args(ap, "rand3m")
    args = ap.parse_args(argv)
    title = f"python bench/bench_ranks.py {' '.join(argv or sys.argv[1:])}, model {args.model}"
    return workload.run_workloads(WORKLOADS,
                                  lambda name: measure(name, WORKLOADS[name],
                                                       args), args, title, table)

if __name__ == "__main__":
    main()
