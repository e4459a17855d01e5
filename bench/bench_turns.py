"""A later turn of a multi-turn rollout, with and without the own sampler's kept caches
(`SamplerEngine.conversation`): turn 1 samples --rows rows from a --prompt-tokens prompt; turn 2
continues every row after a --tool-tokens tool turn, either prefilling only the new tokens (the
conversation keeps turn 1's keys/values) or the whole conversation again (no conversation). The
two ways alternate; prints the median ms of turn 2 and the ratio. From the repo root:

    .venv/bin/python bench/bench_turns.py [--model examples/agent_model] [--prompt-tokens 256]
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> dict:
    from preftune.config.schema import ModelConfig
    from preftune.model.load import load_model
    from preftune.rollout.engine import SamplerEngine

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="examples/agent_model")
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--tool-tokens", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=32, help="tokens sampled per turn")
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args(argv)
    model = load_model(ModelConfig(name_or_path=args.model), args.model, trainable=False)
    V = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(1, V, (args.prompt_tokens,), generator=g).tolist()
    tool = torch.randint(1, V, (args.tool_tokens,), generator=g).tolist()
    opts = dict(model=model, max_new_tokens=args.new_tokens, eos_id=-1, pad_id=0)

    def turn2(keep: bool) -> float:
        engine = SamplerEngine()
        with engine.conversation() if keep else contextlib.nullcontext():
            first = engine.generate([prompt], num_generations=args.rows,
                                    generator=torch.Generator().manual_seed(1), **opts)
            second = [prompt + row + tool for row in first.completion_ids.tolist()]
            t0 = time.perf_counter()
            engine.generate(second, num_generations=1, generator=torch.Generator().manual_seed(2),
                            **opts)
            return 1e3 * (time.perf_counter() - t0)

    times = {"kept prefixes": [], "full prefill": []}
    for _ in range(args.repeats):  # alternate, so load changes hit both ways alike
        times["kept prefixes"].append(turn2(True))
        times["full prefill"].append(turn2(False))
    result = {k: statistics.median(v) for k, v in times.items()}
    print(f"turn 2 of {args.rows} rows: {args.prompt_tokens}-token prompt + {args.new_tokens} "
          f"sampled + {args.tool_tokens} tool tokens, then {args.new_tokens} sampled; "
          f"{torch.get_num_threads()} threads")
    for name, ms in result.items():
        print(f"  {name:16s} {ms:8.1f} ms")
    print(f"  ratio {result['full prefill'] / result['kept prefixes']:.2f}x")
    return result


if __name__ == "__main__":
    main()
