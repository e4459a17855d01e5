"""Routing replay's evidence: how far a mixture of experts' training pass strays from the sampler
that drew the tokens, with and without replaying the sampler's experts (grpo.routing_replay).

A random Qwen3-MoE built here (bench_families.models) samples --prompts x --group completions
with the own sampler (its decode step), then the training pass (packed forward) scores the same
tokens: in float32, and under bf16 autocast on both sides (each path rounds its router logits its
own way). Per setting: the share of (layer, token) pairs whose experts differ
(`moe/routing_mismatch`), the token-level log-ratio |log pi_train - log pi_sampler| (mean, max,
the share above 0.01) and the sequence-level (GSPO) log-ratio, the mean of a row's token
log-ratios. No timings.

    .venv/bin/python bench/bench_replay.py [--hidden 256 --layers 4 --experts 8 --top-k 2]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __package__:
    from bench.bench_families import models
else:  # run as a script: bench/ is on sys.path
    from bench_families import models


def _own(hf, dtype):
    from preftune.model.families import own_class

    return own_class(hf.config).of(hf, autocast_dtype=dtype).eval()


def _measure(model, ro, replay: bool) -> dict:
    from preftune.algorithms.router import Routers, reduce_metrics
    from preftune.distributed.group import Parallel
    from preftune.model.logps import completion_logps

    for m in model.modules():
        if getattr(m, "routed", False):
            m.replay = replay
    routers = Routers.of(model, 0.0)
    lp, _ = completion_logps(model, ro.prompt_ids, ro.prompt_mask, ro.completion_ids,
                             ro.completion_mask, routes=ro.routes)  # (N, T)
    routers.added(torch.zeros(()), 1.0)
    mismatch = reduce_metrics(Parallel(), {}, routers).get("moe/routing_mismatch", 0.0)
    mask = ro.completion_mask.bool()  # (N, T)
    d = (lp.detach() - ro.sampling_logps).masked_fill(~mask, 0.0)  # (N, T) token log-ratios
    seq = d.sum(1) / mask.sum(1)  # (N,) GSPO's log-ratio: the mean over the row's tokens
    tok = d[mask]
    return {"mismatch": mismatch, "token_mean": float(tok.abs().mean()),
            "token_max": float(tok.abs().max()),
            "over_1e-2": float((tok.abs() > 1e-2).float().mean()),
            "seq_mean": float(seq.abs().mean()), "seq_max": float(seq.abs().max())}


def main(argv=None) -> dict:
    from preftune.rollout.sampler import sample

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--std", type=float, default=0.2,
                    help="std of the random weights: larger makes each expert's output matter more")
    args = ap.parse_args(argv)
    hf, _ = models("qwen3_moe", args.hidden, args.layers, num_experts=args.experts,
                   num_experts_per_tok=args.top_k)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, args.std, generator=torch.Generator().manual_seed(p.numel()))
    g = torch.Generator().manual_seed(0)
    p_ids = torch.randint(3, 512, (args.prompts, args.prompt_tokens), generator=g)
    out = {}
    print(f"Qwen3-MoE hidden {args.hidden}, {args.layers} layers, {args.experts} experts, top "
          f"{args.top_k}; {args.prompts} x {args.group} rows of ({args.prompt_tokens} + "
          f"{args.completion}) tokens, weights ~ N(0, {args.std})")
    print(f"{'compute':<8} {'replay':<7} {'mismatch':>9} {'|tok| mean':>11} {'|tok| max':>10} "
          f"{'>1e-2':>9} {'|seq| mean':>11} {'|seq| max':>10}")
    for name, dtype in (("fp32", None), ("bf16", torch.bfloat16)):
        model = _own(hf, dtype)
        with torch.no_grad():
            ro = sample(model, p_ids, torch.ones_like(p_ids), num_generations=args.group,
                        max_new_tokens=args.completion, eos_id=-1, pad_id=0,
                        generator=torch.Generator().manual_seed(1), with_logps=True)
        for replay in (False, True):
            r = _measure(model, ro, replay)
            out[f"{name}/{'replay' if replay else 'free'}"] = r
            print(f"{name:<8} {str(replay).lower():<7} {r['mismatch']:>9.4f} "
                  f"{r['token_mean']:>11.2e} {r['token_max']:>10.2e} {r['over_1e-2']:>9.4f} "
                  f"{r['seq_mean']:>11.2e} {r['seq_max']:>10.2e}")
    return out


if __name__ == "__main__":
    main()
