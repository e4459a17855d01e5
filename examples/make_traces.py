"""Build examples/data/traces.parquet: a labeled trace set sampled from the embedded base model.

For each train prompt (examples/data/train_prompts.jsonl) the base samples SAMPLES_PER_PROMPT
completions (temperature 1.0, no top-k/top-p, max 4 new tokens, fixed seed); each is scored with
`arith.trace_reward` (1.0 correct, < 0.29 for a wrong number, 0.0 unparseable).

Columns: input (str, the prompt), output (str, completion text up to EOS, no EOS/pad),
final_reward (float64 in [0, 1]), answer (str). Offline-RL / DPO demos read it: a prompt with one
output >= 0.7 and one < 0.5 yields a preference pair. Rerun after make_base_model.py (seconds):

    .venv/bin/python examples/make_traces.py
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import arith

HERE = Path(__file__).resolve().parent
SEED = 1234
SAMPLES_PER_PROMPT = 8
MAX_NEW_TOKENS = 4
CHOSEN_MIN, REJECTED_MAX = 0.7, 0.5  # thresholds that define a usable preference pair


@torch.no_grad()
def sample_completions(model, tok, prompts: list[str], n: int, seed: int) -> list[str]:
    """n sampled completions per prompt (prompt-major order), cut at the first EOS and decoded
    without special tokens."""
    torch.manual_seed(seed)
    model.eval()
    tok.padding_side = "left"
    batch = [p for p in prompts for _ in range(n)]
    enc = tok(batch, return_tensors="pt", padding=True)
    out = model.generate(
        **enc, max_new_tokens=MAX_NEW_TOKENS, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
    )  # (B * n, T + new)
    texts = []
    for ids in out[:, enc["input_ids"].shape[1]:].tolist():
        if tok.eos_token_id in ids:
            ids = ids[: ids.index(tok.eos_token_id)]
        texts.append(tok.decode(ids, skip_special_tokens=True))
    return texts


def pair_stats(rows: list[dict]) -> tuple[int, int]:
    """(prompts, prompts with both an output >= CHOSEN_MIN and one < REJECTED_MAX)."""
    by_prompt: dict[str, list[float]] = {}
    for r in rows:
        by_prompt.setdefault(r["input"], []).append(r["final_reward"])
    usable = sum(max(v) >= CHOSEN_MIN and min(v) < REJECTED_MAX for v in by_prompt.values())
    return len(by_prompt), usable


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=HERE / "model")
    ap.add_argument("--out", type=Path, default=HERE / "data" / "traces.parquet")
    args = ap.parse_args()

    torch.set_num_threads(1)  # machine-independent samples, as in make_base_model.py
    train = [
        json.loads(l) for l in (HERE / "data" / "train_prompts.jsonl").read_text().splitlines() if l
    ]
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    outputs = sample_completions(model, tok, [r["input"] for r in train], SAMPLES_PER_PROMPT, SEED)
    rows = []
    for i, text in enumerate(outputs):
        src = train[i // SAMPLES_PER_PROMPT]
        reward = arith.trace_reward(text, src["answer"])
        rows.append({"input": src["input"], "output": text, "final_reward": reward,
                     "answer": src["answer"]})

    schema = pa.schema([("input", pa.string()), ("output", pa.string()),
                        ("final_reward", pa.float64()), ("answer", pa.string())])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), args.out)

    n_prompts, usable = pair_stats(rows)
    correct = sum(r["final_reward"] == 1.0 for r in rows)
    print(f"wrote {args.out}: {len(rows)} rows, {correct} correct ({correct / len(rows):.0%}); "
          f"{usable}/{n_prompts} prompts have a >= {CHOSEN_MIN} and a < {REJECTED_MAX} output")


if __name__ == "__main__":
    main()
