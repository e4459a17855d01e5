"""The floor of identical work on this machine, against the last `make bench`: how fast a step of a
row where preftune and TRL do the same work could be if its training passes ran every matmul at the
speed that matmul reaches alone and nothing else took time (norms, activations, RoPE, the loss, the
optimizer), with attention at PyTorch's flash kernel speed (the fastest attention here). Sampling is
taken as preftune runs it now (its measured seconds in the JSON). TRL's measured step over that
floor is the highest TRL/preftune ratio any eager implementation could reach on the row.

    python bench/bench_floor.py --json bench-full.json   # the identical-work rows of make bench

It prints, per row: TRL's and preftune's s/step from the JSON, the floor and its parts, and the
ratios.
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __package__:
    from bench import workload
else:  # run as a script: bench/ is on sys.path
    import workload

# rows of suite.FULL where both frameworks do the same work: no prompt to share, and DPO with
# 5-token prompts. In the it2 row TRL also runs an old-log-prob pass per generation batch, which
# preftune skips (its first step's forward records them); the floor counts preftune's passes.
ROWS = ("grpo 3M 8x4 T64 b.04", "grpo 3M 4x8 T256 b.04",
        "grpo 3M 8x8 T32 b.04 it2", "dpo 3M short R8 B32", "dpo 3M long R200 B16")


def sibling(name: str):
    """Another bench module, imported as this one was (bench.NAME, or NAME when run as a script)."""
    return importlib.import_module(f"bench.{name}" if __package__ else name)


def settings(name: str) -> tuple[str, argparse.Namespace]:
    """(kind, the bench script's parsed options) of a suite row, from suite.FULL."""
    kind, options = next((k, o) for n, k, o in sibling("suite").FULL if n == name)
    return kind, sibling(f"bench_{kind}").build_parser().parse_args(options.split())


def mm_seconds(m: int, k: int, n: int, repeats: int = 7) -> float:
    """Best seconds of one (m, k) @ (k, n) float32 product into a preallocated output (no page
    faults)."""
    a, b, out = torch.randn(m, k), torch.randn(k, n), torch.empty(m, n)
    torch.mm(a, b, out=out)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b, out=out)
        times.append(time.perf_counter() - t0)
    return min(times)


def attention_seconds(rows: int, seq: int, cfg: dict, backward: bool, repeats: int = 3) -> float:
    """Best seconds of one layer's causal grouped-query attention (SDPA, flash on CPU), forward or
    forward+backward."""
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg["hidden_size"] // h
    q = torch.randn(rows, h, seq, d, requires_grad=backward)
    k, v = (torch.randn(rows, kv, seq, d, requires_grad=backward) for _ in range(2))
    grad = torch.randn(rows, h, seq, d)

    def once():
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if backward:
            o.backward(grad)

    with torch.set_grad_enabled(backward):
        once()
        times = []
        for _ in range(repeats):
            for t in (q, k, v):
                t.grad = None  # each repeat writes fresh gradients, as one backward does
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    return min(times)


def pass_floor(cfg: dict, tokens: int, scored: int, attention: tuple[int, int],
               backward: bool) -> dict:
    """Floor seconds of one pass over `tokens` positions (packed: no padding), `scored` of them
    projected to the vocabulary, attention over `attention` = (rows, seq): {"matmuls": s,
    "attention": s}. With `backward`, each linear's input-gradient and weight-gradient products
    too."""
    H, I, V, L = (
        cfg["hidden_size"],
        cfg["intermediate_size"],
        cfg["vocab_size"],
        cfg["num_hidden_layers"],
    )
    kv = H * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    # (in, out): q k v o gate up down
    linears = [(H, H), (H, kv), (H, kv), (H, H), (H, I), (H, I), (I, H)]
    cache: dict = {}

    def t(m, k, n):
        if (m, k, n) not in cache:
            cache[(m, k, n)] = mm_seconds(m, k, n)
        return cache[(m, k, n)]

    def linear(m, fan_in, fan_out):
        s = t(m, fan_in, fan_out)  # y = x W^T
        if backward:
            s += t(m, fan_out, fan_in) + t(fan_out, m, fan_in)  # dx = dy W, dW = dy^T x
        return s

    matmuls = L * sum(linear(tokens, a, b) for a, b in linears) + linear(scored, H, V)
    return {"matmuls": matmuls, "attention": L * attention_seconds(*attention, cfg, backward)}


def geometry(name: str, bench: dict, model: Path) -> dict:
    """Rows per step and mean prompt and completion tokens of a row, as its bench counts them: GRPO
    from preftune's measured completion tokens per step (sampled lengths), DPO from its pairs."""
    kind, a = settings(name)
    if kind == "dpo":
        bench_dpo = sibling("bench_dpo")
        pairs = bench_dpo.synthetic_pairs(prefix=a.prompt_prefix, response=a.response_len)
        prompt, completion = bench_dpo.mean_lengths(model, pairs)
        return {"kind": kind, "n": a.batch, "rows": 2 * a.batch, "prompt": prompt,
                "completion": completion}
    rows = a.prompts * a.generations
    x = bench["rows"][name]["preftune"]
    return {"kind": kind, "n": a.prompts, "beta": a.beta, "iterations": a.num_iterations, "args": a,
            "rows": rows,
            "prompt": sibling("bench_grpo").mean_prompt_tokens(model, a.prompt_prefix),
            "completion": x["completion_tokens_per_s"] * x["median_s"] / rows}


def row_floor(name: str, bench: dict, model: Path) -> dict:
    """The floor of a row's step. GRPO: every row's prompt and completion (no prompt is shared at
    these shapes). DPO: each pair's prompt once and both responses (preftune's tree packing;
    attention taken as two causal rows per pair, which counts the short prompt's attention twice).
    Timed shapes use the mean lengths rounded; the sampling FLOPs are the bench's own (`grpo_work`),
    from which it measured its rate."""
    g = geometry(name, bench, model)
    cfg = workload.config_of(model)
    rows, prompt, completion = g["rows"], round(g["prompt"]), round(g["completion"])
    seq = prompt + completion
    tokens = g["n"] * (prompt + 2 * completion) if g["kind"] == "dpo" else rows * seq
    train = pass_floor(cfg, tokens, rows * completion, (rows, seq), backward=True)
    out = {"rows": rows, "prompt": prompt, "completion": completion, "train": sum(train.values()),
           "attention": train["attention"], "reference": 0.0, "sampling": 0.0}
    if g["kind"] == "grpo":
        if g["beta"] > 0:  # the reference pass once per generation batch
            ref = pass_floor(cfg, tokens, rows * completion, (rows, seq), backward=False)
            out["reference"] = sum(ref.values()) / g["iterations"]
        # preftune's measured rate
        rate = bench["rows"][name]["preftune"]["phase_gflops"]["sampling"] * 1e9
        out["sampling"] = sibling("bench_grpo").grpo_work(g["args"], model,
                                                          g["completion"])["sampling"] / rate
    out["floor"] = out["train"] + out["reference"] + out["sampling"]
    out["trl"], out["preftune"] = (
        bench["rows"][name][fw]["median_s"] for fw in ("trl", "preftune")
    )
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench-full.json",
                    help="a make bench JSON (the rows' TRL and preftune times)")
    ap.add_argument("--only", default="", help="rows whose name contains this")
    ap.add_argument("--model-cache", default="/tmp/preftune-bench-models")
    args = ap.parse_args(argv)
    bench = json.loads(Path(args.json).read_text())
    model = workload.model_dir("rand3m", args.model_cache)
    # also warms the thread pool before the first timed product
    peak = workload.matmul_peak_gflops()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 matmul peak "
          f"{peak:.1f} GFLOP/s (1024 x 1024); step times from {args.json}, floors measured now")
    print("| row | rows x (prompt + completion) | TRL s/step | preftune s/step | floor s/step "
          "(train + ref + sampling) | TRL/preftune | TRL/floor |")
    print("|---|---|---|---|---|---|---|")
    out = {}
    for name in ROWS:
        if args.only not in name or name not in bench.get("rows", {}):
            continue
        r = out[name] = row_floor(name, bench, model)
        print(f"| {name} | {r['rows']} x ({r['prompt']} + {r['completion']}) | {r['trl']:.3f} | "
              f"{r['preftune']:.3f} | {r['floor']:.3f} ({r['train']:.3f} + {r['reference']:.3f} + "
              f"{r['sampling']:.3f}) | {r['trl'] / r['preftune']:.2f}x | "
              f"{r['trl'] / r['floor']:.2f}x |", flush=True)
    return out


if __name__ == "__main__":
    main()
