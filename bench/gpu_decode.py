"""The own module on a GPU, side by side with the Hugging Face module, on one shape:

- decoding: the sampler with the Hugging Face module (`hf`) and with preftune's own module (`own`):
  seconds per rollout, ms per token, new tokens per second; the share of greedy tokens equal to
  `hf`'s is reported (in bf16 a last-bit difference can flip a near-tie);
- a training pass (forward+backward of `completion_logps`) of the own module eagerly and with
  per-block `torch.compile` (`model.compile: true`): ms per pass, the compile in the first one.

Timing: median of --repeats after one warm-up, with torch.cuda.synchronize. Exit 1 when a
variant fails to run.

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


def load(args, *, own: bool, compile_blocks: bool = False):
    from preftune.config import ModelConfig
    from preftune.model.load import load_model

    path = workload.model_dir(args.model, args.model_cache or tempfile.mkdtemp())
    cfg = ModelConfig(dtype="bfloat16" if args.bf16 else "float32", lean_forward=own,
                      compile=compile_blocks)
    # bf16: float32 masters under bf16 autocast, as training
    return load_model(cfg, path).to(args.device)


def prompts(args, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random byte-range prompts of --prompt-len tokens, every other one shorter (left padding)."""
    from preftune.data.tensors import left_pad

    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(3, min(vocab, 259), (args.prompt_len - (i % 2) * (args.prompt_len // 4),),
                          generator=g).tolist() for i in range(args.prompts)]
    return left_pad(seqs, pad_id=0)


def _timed(fn, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


def decode(model, ids, mask, args, greedy: bool):
    from preftune.rollout.sampler import sample

    return sample(model, ids, mask, num_generations=args.generations,
                  max_new_tokens=args.max_new_tokens,
                  eos_id=-1, pad_id=0, greedy=greedy,
                  generator=torch.Generator(args.device).manual_seed(0))


def decode_rows(args, ids, mask) -> dict:
    rows = {}
    for name in ("hf", "own"):
        model = load(args, own=name == "own")
        greedy = decode(model, ids, mask, args, True).completion_ids.cpu()
        times = [
            _timed(lambda: decode(model, ids, mask, args, False), args.device)[0]
            for _ in range(args.repeats)
        ]
        s = statistics.median(times)
        rows[name] = {"s_per_rollout": s, "ms_per_token": 1e3 * s / args.max_new_tokens,
                      "new_tokens_per_s": greedy.numel() / s, "greedy": greedy}
    rows["own"]["equal_to_hf_greedy"] = float(
        (rows["own"]["greedy"] == rows["hf"]["greedy"]).float().mean()
    )
    return rows


def pass_rows(args, ids, mask) -> dict:
    from preftune.model.logps import completion_logps

    comp = torch.randint(3, 250, (ids.size(0), args.max_new_tokens), device=args.device)
    rows = {}
    for name in ("eager", "compiled blocks"):
        model = load(args, own=True, compile_blocks=name != "eager")

        def run():
            lp, _ = completion_logps(model, ids, mask, comp, torch.ones_like(comp))
            lp.sum().backward()
            model.zero_grad(set_to_none=True)

        first, _ = _timed(run, args.device)
        times = [_timed(run, args.device)[0] for _ in range(args.repeats)]
        rows[name] = {"first_s": first, "ms_per_pass": 1e3 * statistics.median(times)}
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="rand0.5b", help="a bench/workload.py model name or a path")
    ap.add_argument("--model-cache", help="folder for generated models (default: a temporary one)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--bf16", default="true", choices=("true", "false"),
                    help="bf16 autocast over float32 masters")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--generations", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--compile", default="true", choices=("true", "false"),
                    help="time per-block torch.compile too")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    args.bf16 = args.bf16 == "true"
    ids, mask = (t.to(args.device) for t in prompts(args, 259))
    result = {"settings": dict(vars(args)), "decode": decode_rows(args, ids, mask), "pass": {}}
    if args.compile == "true":
        result["pass"] = pass_rows(args, ids.repeat_interleave(args.generations, 0),
                                   mask.repeat_interleave(args.generations, 0))
    print(f"{args.prompts} prompts x {args.generations}, prompt {args.prompt_len}, "
          f"{args.max_new_tokens} new tokens, model {args.model}, "
          f"{'bf16 autocast' if args.bf16 else 'float32'}, {args.device}")
    print("| decoder | s/rollout | ms/token | new tokens/s | vs hf |")
    print("|---|---|---|---|---|")
    hf = result["decode"]["hf"]["s_per_rollout"]
    for v, r in result["decode"].items():
        print(f"| {v} | {r['s_per_rollout']:.3f} | {r['ms_per_token']:.2f} | "
              f"{r['new_tokens_per_s']:.0f} | {hf / r['s_per_rollout']:.2f}x |")
    print(f"own greedy tokens equal to hf's: {result['decode']['own']['equal_to_hf_greedy']:.3f}")
    for v, r in result["pass"].items():
        print(f"training pass, {v}: {r['ms_per_pass']:.1f} ms (first {r['first_s']:.1f} s)")
    if args.json:
        for r in result["decode"].values():
            r.pop("greedy")
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
