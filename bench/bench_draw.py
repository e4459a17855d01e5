"""One sampling draw (n rows x V scores -> n tokens) three ways, on this machine's CPU (or GPU):
preftune's Gumbel-max with noise from uniforms and two logs (`rollout.sampler.draw`), Gumbel-max
with `exponential_` noise (preftune's earlier draw), and softmax + multinomial (what HF `generate`
sampling, and so TRL, does). Prints ms per draw (median of --repeats).

    python bench/bench_draw.py                       # 32 rows, vocabulary 151936 (Qwen2.5's)
    python bench/bench_draw.py --rows 256 --vocab 32768
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def timed(fn, repeats: int, sync) -> float:
    fn()
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main(argv=None) -> dict:
    from preftune.rollout.sampler import draw

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    g = torch.Generator(args.device).manual_seed(0)
    scores = torch.randn(args.rows, args.vocab, generator=g, device=args.device)  # (n, V)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    ways = {
        "preftune draw (uniform noise)": lambda: draw(scores, 1.0, 0, 1.0, False, g),
        "exponential_ noise": lambda: (
            scores - torch.empty_like(scores).exponential_(generator=g).log_()
        ).argmax(-1),
        "softmax + multinomial": lambda: torch.multinomial(scores.softmax(-1), 1, generator=g),
    }
    result = {name: timed(fn, args.repeats, sync) for name, fn in ways.items()}
    print(f"{args.rows} rows x {args.vocab} scores on "
          f"{args.device}, {torch.get_num_threads()} threads")
    for name, ms in result.items():
        print(f"  {name:32s} {ms:8.2f} ms")
    return result


if __name__ == "__main__":
    main()
