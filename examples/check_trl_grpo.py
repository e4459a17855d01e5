"""Check that the embedded base (examples/model/) is RL-able, using TRL's GRPOTrainer as reference.

Recipe (the one preftune's `make demo` should match): 16 prompts x G=16 completions per step
(TRL counts completions: per_device_train_batch_size = 256), max_completion_length 4,
temperature 1.0, lr 3e-4 decayed linearly to 0 (TRL's default), beta 0 (no reference model),
200 steps, 0/1 correctness reward against the `answer` column. Prints held-out greedy accuracy
before, every 50 steps and after, and s/step. The decay matters: with a constant 3e-4 the last
model lands at a random point of an oscillation (same base: +0.23, +0.01 over two seeds).
Writes only to a temp dir. Needs TRL (a test dependency), ~2 minutes on 2 CPU cores:

    .venv/bin/python examples/check_trl_grpo.py [--steps 200]
"""
from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer

import arith
from make_base_model import greedy_accuracy

HERE = Path(__file__).resolve().parent


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def correctness(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """TRL reward function: 1.0 iff the completion equals the row's answer."""
    return arith.correctness_reward(completions, answer)


class HeldOutEval(TrainerCallback):
    """Print held-out greedy accuracy every `every` optimizer steps (the demo's eval cadence)."""

    def __init__(self, tok, rows: list[dict], every: int):
        self.tok, self.rows, self.every = tok, rows, every

    def on_step_end(self, args, state, control, model=None, **_):
        if state.global_step % self.every == 0:
            acc = greedy_accuracy(model, self.tok, self.rows)
            print(f"step {state.global_step}: held-out greedy accuracy {acc:.2f}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=HERE / "model")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--lr-schedule", default="linear", help="TRL/transformers lr_scheduler_type")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1: no spin-wait thrash)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    train = read_jsonl(HERE / "data" / "train_prompts.jsonl")
    evals = read_jsonl(HERE / "data" / "eval_prompts.jsonl")
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    before = greedy_accuracy(model, tok, evals)
    print(f"held-out greedy accuracy before: {before:.2f}", flush=True)

    ds = Dataset.from_list([{"prompt": r["input"], "answer": r["answer"]} for r in train])
    with tempfile.TemporaryDirectory() as out:
        cfg = GRPOConfig(output_dir=out, max_steps=args.steps, per_device_train_batch_size=256,
                         num_generations=16, max_completion_length=4, temperature=1.0,
                         learning_rate=3e-4, beta=0.0, lr_scheduler_type=args.lr_schedule,
                         warmup_steps=0, use_cpu=True, bf16=False, gradient_checkpointing=False,
                         report_to="none", save_strategy="no", logging_steps=20, seed=args.seed,
                         dataloader_num_workers=0, disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=correctness, args=cfg,
                              train_dataset=ds, processing_class=tok,
                              callbacks=[HeldOutEval(tok, evals, args.eval_every)])
        t0 = time.time()
        trainer.train()
        dt = time.time() - t0
    after = greedy_accuracy(trainer.model, tok, evals)
    print(f"held-out greedy accuracy: before {before:.2f} -> after {after:.2f} (delta "
          f"{after - before:+.2f}); "
          f"{args.steps} steps in {dt:.0f} s = {dt / args.steps:.2f} s/step")


if __name__ == "__main__":
    main()
