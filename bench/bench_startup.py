"""What a restart pays before its first step in imports: `startup/imports` of `preftune train` (from
the process start until the model libraries are imported, docs/checkpoints.md), and which packages
the imports spend it on. From the repo root:

    .venv/bin/python bench/bench_startup.py [--runs 3] [--against DIR] [--json startup.json]
        [KEY=VALUE ...]

The job is `preftune train examples/grpo.yaml max_steps=1` (progress bar off), each run into a
fresh folder. Reported: the median `startup/imports` and `startup_seconds` of the runs (the run's
own metrics), then one more run under `python -X importtime`: the import time by top-level package
(self times summed; importtime's own overhead inflates them, so compare shares, not seconds) and
which of the packages a GRPO run on jsonl prompts does not need were imported. Record the machine
load (printed) with the numbers: on a shared machine they move with it. `--against DIR` (another
checkout, e.g. `git worktree add ../prev HEAD~1`) runs the same job from there too, alternating
the two run by run, and prints both medians and their ratio (this checkout / that one).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "examples/grpo.yaml"
# imported by a GRPO run on jsonl prompts without LoRA, trackers, vLLM or S3 only if something
# imports too much
# (fsspec opens local files too; torch._dynamo and sympy come with torch's AdamW)
NOT_NEEDED = ("pyarrow", "pandas", "peft", "vllm", "wandb", "mlflow",
              "tensorboard", "matplotlib",
              "s3fs", "jsonschema", "kubernetes_validate", "preftune.data.inspect",
              # the own module's folder: config.json and the tokenizer are read without it
              "transformers")
IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def command(out: Path, overrides: list[str], importtime: bool = False) -> list[str]:
    flags = ["-X", "importtime"] if importtime else []
    return [sys.executable, *flags, "-m", "preftune", "train", CONFIG,
            f"output_dir={out}", "max_steps=1", "log.progress_bar=false", *overrides]


def run_once(overrides: list[str], importtime: bool = False,
             root: Path = ROOT) -> tuple[dict, str]:
    """The first training record's startup metrics, and stderr (importtime's lines), of the
    checkout at `root`."""
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    with tempfile.TemporaryDirectory(prefix="bench-startup-") as tmp:
        out = Path(tmp) / "run"
        proc = subprocess.run(command(out, overrides, importtime), cwd=root,
                              env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode != 0:
            raise SystemExit(f"preftune train exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        records = [
            json.loads(line)
            for line in (out / "metrics.jsonl").read_text().splitlines()
            if line.strip()
        ]
    first = next(r for r in records if "startup_seconds" in r)
    return {k: v for k, v in first.items() if k.startswith("startup")}, proc.stderr


def import_profile(stderr: str) -> dict:
    """Self time (s) by top-level package, and the watched modules that were imported."""
    by_package: Counter = Counter()
    names = set()
    for line in stderr.splitlines():
        m = IMPORT_LINE.match(line)
        if m:
            by_package[m[4].split(".")[0]] += int(m[1]) / 1e6
            names.add(m[4])
    total = sum(by_package.values())
    imported = [w for w in NOT_NEEDED if any(n == w or n.startswith(w + ".") for n in names)]
    return {"total_s": round(total, 3),
            "top": {k: round(v, 3) for k, v in by_package.most_common(12)},
            "not_needed_but_imported": imported}


def summary(runs: list[dict]) -> dict:
    return {"startup/imports_median_s": statistics.median(r["startup/imports"] for r in runs),
            "startup_seconds_median_s": statistics.median(r["startup_seconds"] for r in runs),
            "startup/imports_s": [round(r["startup/imports"], 3) for r in runs],
            "startup_seconds_s": [round(r["startup_seconds"], 3) for r in runs]}


def load() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--against", default=None, help="another checkout to alternate with")
    ap.add_argument("--json", default=None, help="also write the result here")
    ap.add_argument("overrides", nargs="*", help="KEY=VALUE added to the command")
    args = ap.parse_args(argv)
    before = load()
    roots = [ROOT] + ([Path(args.against).resolve()] if args.against else [])
    runs: dict[Path, list] = {r: [] for r in roots}
    for _ in range(args.runs):
        for root in roots:  # alternated: a change of load falls on both alike
            runs[root].append(run_once(args.overrides, root=root)[0])
    _, stderr = run_once(args.overrides, importtime=True)
    result = {"command": " ".join(command(Path("OUT"), args.overrides)[1:]), "runs": args.runs,
              "load_before": before, "load_after": load(), **summary(runs[ROOT]),
              "importtime": import_profile(stderr)}
    if args.against:
        that = summary(runs[roots[1]])
        result["against"] = {"checkout": str(roots[1]), **that,
                             "importtime": import_profile(run_once(args.overrides, True,
                                                                   roots[1])[1])}
        result["ratio_imports"] = round(result["startup/imports_median_s"]
                                        / that["startup/imports_median_s"], 3)
        result["ratio_startup"] = round(result["startup_seconds_median_s"]
                                        / that["startup_seconds_median_s"], 3)
    print(json.dumps(result, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
