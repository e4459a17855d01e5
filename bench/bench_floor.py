"""The floor of identical work on this machine, against the last `make bench`: how fast a step of a row
where preftune and TRL do the same work could be if its training passes ran every matmul at the speed
that matmul reaches alone and nothing else took time (norms, activations, RoPE, the loss, the
optimizer), with attention at PyTorch's flash kernel speed (the fastest attention here). Sampling is
taken as preftune runs it now (its measured seconds in the JSON). TRL's measured step over that floor
is the highest TRL/preftune ratio any eager implementation could reach on the row.

    python bench/bench_floor.py --json bench-full.json          # the identical-work rows of make bench

It prints, per row: TRL's and preftune's s/step from the JSON, the floor and its parts, and the ratios.
"""
from __future__ import annotations

import argparse
import json
import statistics
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

# rows of suite.FULL where both frameworks do the same work (no shared prompt to skip, beta > 0 or DPO
# with short prompts), with their geometry: (kind, prompts or pairs, G, beta, num_iterations, response length)
ROWS = {
    "grpo 3M 8x4 T64 b.04": ("grpo", 8, 4, 0.04, 1, 0),
    "grpo 3M 4x8 T256 b.04": ("grpo", 4, 8, 0.04, 1, 0),
    "grpo 3M 8x8 T32 b.04 it2": ("grpo", 8, 8, 0.04, 2, 0),
    "dpo 3M short R8 B32": ("dpo", 32, 2, 0.0, 1, 8),
    "dpo 3M long R200 B16": ("dpo", 16, 2, 0.0, 1, 200),
}


def mm_seconds(m: int, k: int, n: int, repeats: int = 7) -> float:
    """Best seconds of one (m, k) @ (k, n) float32 product into a preallocated output (no page faults)."""
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
            t0 = time.perf_counter()
            once()
            times.append(time.perf_counter() - t0)
    return min(times)


def pass_floor(cfg: dict, tokens: int, scored: int, attention: tuple[int, int], backward: bool) -> dict:
    """Floor seconds of one pass over `tokens` positions (packed: no padding), `scored` of them
    projected to the vocabulary, attention over `attention` = (rows, seq): {"matmuls": s,
    "attention": s}. With `backward`, each linear's input-gradient and weight-gradient products too."""
    H, I, V, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
    kv = H * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    linears = [(H, H), (H, kv), (H, kv), (H, H), (H, I), (H, I), (I, H)]  # (in, out): q k v o gate up down
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


def geometry(name: str, bench: dict, model: Path) -> tuple[int, int, int, int]:
    """(rows, prompt tokens, completion tokens, completions per row scored) of a row, from its settings
    and preftune's measured completion tokens per step (GRPO completions have sampled lengths)."""
    from transformers import AutoTokenizer

    kind, n, G, _, _, response = ROWS[name]
    tok = AutoTokenizer.from_pretrained(model)
    prompt = round(statistics.fmean(len(tok(r["input"]).input_ids) for r in workload.prompt_rows(0)[:64]))
    rows = n * G
    if kind == "dpo":
        filler = (workload.FILLER * (response // len(workload.FILLER) + 1))[:max(response - 3, 0)]
        answers = [r["answer"] for r in workload.prompt_rows(0)[:64]]
        completion = round(statistics.fmean(len(tok(a + filler, verbose=False).input_ids) for a in answers))
    else:
        x = bench["rows"][name]["preftune"]
        completion = round(x["completion_tokens_per_s"] * x["median_s"] / rows)
    return rows, prompt, completion, completion


def row_floor(name: str, bench: dict, model: Path) -> dict:
    """The floor of a row's step. GRPO: every row's prompt and completion (no prompt is shared at these
    shapes). DPO: each pair's prompt once and both responses (preftune's tree packing; attention taken
    as two causal rows per pair, which counts the short prompt's attention twice)."""
    kind, n, G, beta, iterations, _ = ROWS[name]
    cfg = workload.config_of(model)
    rows, prompt, completion, scored = geometry(name, bench, model)
    seq = prompt + completion
    tokens = n * (prompt + 2 * completion) if kind == "dpo" else rows * seq
    train = pass_floor(cfg, tokens, rows * scored, (rows, seq), backward=True)
    out = {"rows": rows, "prompt": prompt, "completion": completion, "train": sum(train.values()),
           "attention": train["attention"], "reference": 0.0, "sampling": 0.0}
    if kind == "grpo":
        if beta > 0:  # the reference pass once per generation batch (old log-probs come from the first step's forward)
            ref = pass_floor(cfg, tokens, rows * scored, (rows, seq), backward=False)
            out["reference"] = sum(ref.values()) / iterations
        x = bench["rows"][name]["preftune"]
        flops = workload.grpo_flops(workload.model_shape(model), prompts=n, G=G, prompt=prompt, completion=completion,
                                    beta=beta, num_iterations=iterations)
        out["sampling"] = flops["sampling"] / (x["phase_gflops"]["sampling"] * 1e9)  # preftune's measured rate
    out["floor"] = out["train"] + out["reference"] + out["sampling"]
    out["trl"], out["preftune"] = (bench["rows"][name][fw]["median_s"] for fw in ("trl", "preftune"))
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", default="bench-full.json", help="a make bench JSON (the rows' TRL and preftune times)")
    ap.add_argument("--only", default="", help="rows whose name contains this")
    ap.add_argument("--model-cache", default="/tmp/preftune-bench-models")
    args = ap.parse_args(argv)
    bench = json.loads(Path(args.json).read_text())
    model = workload.model_dir("rand3m", args.model_cache)
    peak = workload.matmul_peak_gflops()  # also warms the thread pool before the first timed product
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, float32 matmul peak {peak:.1f} GFLOP/s "
          f"(1024 x 1024); step times from {args.json}, floors measured now")
    print("| row | rows x (prompt + completion) | TRL s/step | preftune s/step | floor s/step (train + ref + "
          "sampling) | TRL/preftune | TRL/floor |")
    print("|---|---|---|---|---|---|---|")
    out = {}
    for name in ROWS:
        if args.only not in name or name not in bench.get("rows", {}):
            continue
        r = out[name] = row_floor(name, bench, model)
        print(f"| {name} | {r['rows']} x ({r['prompt']} + {r['completion']}) | {r['trl']:.3f} | {r['preftune']:.3f} | "
              f"{r['floor']:.3f} ({r['train']:.3f} + {r['reference']:.3f} + {r['sampling']:.3f}) | "
              f"{r['trl'] / r['preftune']:.2f}x | {r['trl'] / r['floor']:.2f}x |", flush=True)
    return out


if __name__ == "__main__":
    main()
