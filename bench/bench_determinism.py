"""What exactness costs: the same GRPO run with `full_determinism` off and on, alternated, on this
machine's device (CUDA when there is one). From the repo root:

    .venv/bin/python bench/bench_determinism.py [--rounds 2] [--json det.json] [KEY=VALUE ...]

Each run is `preftune train examples/grpo.yaml` (progress bar off, no eval, no saves) into a fresh
folder, in its own process. Reported: the median s/step of each setting (steps 3 and later), their
ratio, and whether the two runs of each setting ended with bitwise-equal weights (sha256 of
final/model.safetensors). Record the machine load (printed) with the numbers.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, determinism: bool, overrides: list[str]) -> tuple[float, str]:
    cmd = [sys.executable, "-m", "preftune", "train", "examples/grpo.yaml",
           f"output_dir={out}", "max_steps=20",
           "save_steps=0", "eval.eval_steps=0", "log.progress_bar=false",
           f"full_determinism={str(determinism).lower()}", *overrides]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   env=dict(os.environ, PYTHONPATH=str(ROOT)))
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["step_time"] for r in rows if "step_time" in r and r.get("step", 0) >= 3]
    digest = hashlib.sha256((out / "final" / "model.safetensors").read_bytes()).hexdigest()[:16]
    return statistics.median(times), digest


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    print(f"load average before: {os.getloadavg()}")
    seen: dict[bool, list] = {False: [], True: []}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for det in (False, True):  # alternated: a drifting machine moves both settings alike
                seen[det].append(run(Path(tmp) / f"{r}-{det}", det, args.overrides))
    out = {}
    for det, runs in seen.items():
        s = statistics.median(t for t, _ in runs)
        out[f"full_determinism={det}"] = {"s_per_step": s,
                                          "bitwise_equal": len({d for _, d in runs}) == 1}
        print(f"full_determinism={str(det).lower():5}  {s:.4f} s/step  runs bitwise equal: "
              f"{out[f'full_determinism={det}']['bitwise_equal']}")
    ratio = out["full_determinism=True"]["s_per_step"] / out["full_determinism=False"]["s_per_step"]
    print(f"cost of full_determinism: {ratio:.2f}x per step; load average after: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps(out | {"ratio": ratio}, indent=2) + "\n")


if __name__ == "__main__":
    main()
