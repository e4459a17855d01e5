"""Decoding on a GPU: the sampler's decoders side by side on one rollout shape.

- `hf`: the Hugging Face module's forward with preallocated cache layers;
- `lean`: preftune's lean decoder, eagerly (the default), finished rows leaving the batch;
- `static`: the fixed-shape step, eagerly (every row, the whole buffer width);
- `graphed`: the fixed-shape step captured once per rollout as a CUDA graph and replayed
  (`model.cuda_graphs: true`; CUDA only).

Checks, each printed as a line and in the JSON: `graphed` gives `static`'s greedy and seeded
sampled tokens (the same kernels, replayed; both draw noise for every row, so they see the same
stream). `hf` and `static` against `lean` are reported as shares of equal greedy tokens: different
shapes may take different kernels, and in bf16 a last-bit difference can flip a near-tie among a
random model's 152k tokens. Timing: seconds per rollout (median of --repeats after one warm-up,
with torch.cuda.synchronize; `graphed` includes its capture, once per rollout) and new tokens per
second. Exit 1 when a check fails.

    python3 bench/gpu_decode.py --json out.json                  # on the GPU machine (bench/gpu.sh)
    python bench/gpu_decode.py --device cpu --model demo --bf16 false --prompts 2 --max-new-tokens 8
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__:
    from bench import workload
else:  # run as a script: bench/ is on sys.path
    import workload

sys.path.insert(0, str(workload.ROOT))

VARIANTS = ("hf", "lean", "static", "graphed")


def load(args):
    from transformers import AutoModelForCausalLM

    path = workload.model_dir(args.model, args.model_cache or tempfile.mkdtemp())
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device)
    if args.bf16:
        model.preftune_autocast = torch.bfloat16  # float32 masters under bf16 autocast, as training samples
    return model


def prompts(args, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte-range prompts of --prompt-len tokens, every other one shorter (left padding)."""
    from preftune.data.tensors import left_pad

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, min(vocab, 259), (args.prompt_len - (i % 2) * (args.prompt_len // 4),),
                          generator=g).tolist() for i in range(args.prompts)]
    return left_pad(seqs, pad_id=0)


def rollout(model, variant: str, ids, mask, args, *, greedy: bool):
    """One `sample` call through the variant's decoder -> (completion ids (N, T), seconds)."""
    from preftune.model import llama as D
    from preftune.rollout import sampler as S

    saved = D.supported, S._decoder, getattr(model, "preftune_cuda_graphs", False)
    if variant == "hf":
        D.supported = lambda m: False
    elif variant == "static":
        S._decoder = lambda m, capacity: S._StaticDecoder(D.Lean(m, decoding=True), capacity)
    model.preftune_cuda_graphs = variant == "graphed"
    try:
        sync = torch.cuda.synchronize if ids.device.type == "cuda" else (lambda: None)
        sync()
        t0 = time.perf_counter()
        ro = S.sample(model, ids, mask, num_generations=args.generations, max_new_tokens=args.max_new_tokens,
                      eos_id=-1, pad_id=0, temperature=1.0, greedy=greedy,  # no EOS: every row runs T tokens
                      generator=torch.Generator(ids.device).manual_seed(1))
        sync()
        return ro.completion_ids, time.perf_counter() - t0
    finally:
        D.supported, S._decoder, model.preftune_cuda_graphs = saved


def measure(model, variants, ids, mask, args) -> dict:
    rows = {}
    for v in variants:
        greedy, _ = rollout(model, v, ids, mask, args, greedy=True)
        sampled, _ = rollout(model, v, ids, mask, args, greedy=False)  # also the warm-up for the timing
        times = [rollout(model, v, ids, mask, args, greedy=False)[1] for _ in range(args.repeats)]
        s = statistics.median(times)
        rows[v] = {"s_per_rollout": s, "ms_per_token": 1e3 * s / args.max_new_tokens,
                   "new_tokens_per_s": greedy.numel() / s, "greedy": greedy.cpu(), "sampled": sampled.cpu()}
    return rows


def checks(rows: dict) -> dict:
    """The graph replays the eager fixed-shape step: the same tokens, greedy and sampled."""
    if "graphed" not in rows:
        return {}
    return {f"{kind} graphed == static": bool(torch.equal(rows["graphed"][kind], rows["static"][kind]))
            for kind in ("greedy", "sampled")}


def shares(rows: dict) -> dict:
    """Share of greedy tokens equal to the lean decoder's, per other eager decoder."""
    lean = rows["lean"]["greedy"]
    return {v: float((rows[v]["greedy"] == lean).float().mean()) for v in ("hf", "static")}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="rand0.5b", help="a bench/workload.py model name or a path")
    ap.add_argument("--model-cache", help="folder for generated models (default: a temporary one)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bf16", default="true", choices=("true", "false"), help="bf16 autocast over float32 masters")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    args.bf16 = args.bf16 == "true"
    model = load(args)
    ids, mask = (t.to(args.device) for t in prompts(args, model.config.vocab_size))
    variants = [v for v in VARIANTS if v != "graphed" or args.device == "cuda"]
    rows = measure(model, variants, ids, mask, args)
    result = {"settings": {k: v for k, v in vars(args).items()}, "checks": checks(rows),
              "equal_to_lean_greedy": shares(rows),
              "rows": {v: {k: x for k, x in r.items() if k not in ("greedy", "sampled")} for v, r in rows.items()}}
    print(f"decode: {args.prompts} prompts x {args.generations}, prompt {args.prompt_len}, {args.max_new_tokens} new "
          f"tokens, model {args.model}, {'bf16 autocast' if args.bf16 else 'float32'}, {args.device}")
    print("| decoder | s/rollout | ms/token | new tokens/s | vs hf |")
    print("|---|---|---|---|---|")
    for v, r in result["rows"].items():
        print(f"| {v} | {r['s_per_rollout']:.3f} | {r['ms_per_token']:.2f} | {r['new_tokens_per_s']:.0f} | "
              f"{result['rows']['hf']['s_per_rollout'] / r['s_per_rollout']:.2f}x |")
    for name, ok in result["checks"].items():
        print(f"check {name}: {'ok' if ok else 'FAILED'}")
    for v, share in result["equal_to_lean_greedy"].items():
        print(f"{v} greedy tokens equal to lean's: {share:.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0 if all(result["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
