"""The own module against the Hugging Face module, per family it runs (Qwen2 as the baseline,
GLM-4, Qwen3-MoE), on random models of one size built here (no download), this machine's CPU:

- a GRPO log-prob pass with grad: groups of `--group` rows sharing a prompt, `completion_logps`
  (own: packed, each prompt once; HF: plain rows), forward + backward;
- a rollout (`rollout.sampler.sample`, greedy to a fixed length): the own prefill + decode step
  against the HF module's forward with a preallocated cache.

Each pair alternates `--rounds` times; the best round's median ms per way, and HF / own.

    python bench/bench_families.py                       # hidden 256, 4 layers, 16 rows x (64 + 32)
    python bench/bench_families.py --families glm4 --rows 4 --completion 4 --repeats 1 --rounds 1
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if __package__:
    from bench.bench_passes import alternate
else:  # run as a script: bench/ is on sys.path
    from bench_passes import alternate

FAMILIES = {
    "qwen2": {},
    "glm4": {"head_dim": 64, "partial_rotary_factor": 0.5},
    "qwen3_moe": {"head_dim": 64, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 256, "norm_topk_prob": True},
}


def models(family: str, hidden: int, layers: int, **extra):
    """(the HF module, the own module) of a random `family` model with the same weights; `extra`:
    config values over the family's."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from preftune.model.families import own_class

    kw = dict(vocab_size=512, hidden_size=hidden, intermediate_size=4 * hidden,
              num_hidden_layers=layers,
              num_attention_heads=hidden // 64,
              num_key_value_heads=max(1, hidden // 128), pad_token_id=0,
              eos_token_id=1, bos_token_id=None, tie_word_embeddings=False,
              max_position_embeddings=512)
    if family.endswith("_moe"):
        kw["experts_implementation"] = "eager"
    torch.manual_seed(0)
    config = AutoConfig.for_model(family, **(kw | FAMILIES[family] | extra))
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for p in hf.parameters():  # HF leaves some at 0 or empty: every weight random and small
            p.normal_(0, 0.05)
    return hf.train(), own_class(hf.config).of(hf).train()


def logps_pass(hf, own, args) -> dict:
    from preftune.model.logps import completion_logps

    g = torch.Generator().manual_seed(1)
    B, P, T = args.rows, args.prompt, args.completion
    # (B, P)
    p_ids = torch.randint(3, 512, (B // args.group, P),
                          generator=g).repeat_interleave(args.group, 0)
    c_ids = torch.randint(3, 512, (B, T), generator=g)
    masks = torch.ones(B, P, dtype=torch.long), torch.ones(B, T, dtype=torch.long)

    def run(model):
        lp, _ = completion_logps(model, p_ids, masks[0], c_ids, masks[1])
        lp.sum().backward()
        model.zero_grad(set_to_none=True)

    return alternate({"hf": lambda: run(hf), "own": lambda: run(own)}, args.repeats, args.rounds)


def rollout(hf, own, args) -> dict:
    from preftune.rollout.sampler import sample

    g = torch.Generator().manual_seed(2)
    groups = max(1, args.rows // args.group)
    p_ids, p_mask = torch.randint(3, 512, (groups, args.prompt),
                                  generator=g), torch.ones(groups, args.prompt,
                                                           dtype=torch.long)

    def run(model):
        with torch.no_grad():
            sample(model.eval(), p_ids, p_mask, num_generations=args.group,
                   max_new_tokens=args.completion, eos_id=-1,
                   pad_id=0, generator=torch.Generator().manual_seed(1))
        model.train()

    return alternate({"hf": lambda: run(hf), "own": lambda: run(own)}, args.repeats, args.rounds)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--group", type=int, default=8, help="rows per shared prompt")
    ap.add_argument("--prompt", type=int, default=64)
    ap.add_argument("--completion", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args(argv)
    out = {}
    print(f"hidden {args.hidden}, {args.layers} layers, {args.rows} rows (groups of {args.group}) "
          f"x ({args.prompt} + {args.completion}) tokens, {torch.get_num_threads()} threads; ms, "
          f"best of {args.rounds} alternating rounds (median of {args.repeats})")
    print(f"{'family':<10} {'pass':<22} {'HF ms':>9} {'own ms':>9} {'HF/own':>7}")
    for family in args.families:
        hf, own = models(family, args.hidden, args.layers)
        for name, fn in (("log-probs fwd+bwd", logps_pass), ("rollout", rollout)):
            r = fn(hf, own, args)
            out[f"{family}/{name}"] = r | {"ratio": r["hf"] / r["own"]}
            print(f"{family:<10} {name:<22} {r['hf']:>9.1f} {r['own']:>9.1f} "
                  f"{r['hf'] / r['own']:>7.2f}")
    return out


if __name__ == "__main__":
    main()
