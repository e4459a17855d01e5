"""The demo task: add two small integers.

Format (character level, no BOS, no spaces):

    prompt     "12+7="           (the row's `input`)
    completion "19" + <eos>      (the row's `answer`, then the EOS token)

All pairs (a, b) with 0 <= a, b <= 19 form the universe (400 prompts); `make_split` shuffles it
with a seed into disjoint train / eval sets. The embedded base model half-knows this table, so RL
on the train prompts can raise held-out accuracy.

Pure Python on purpose: reward code imports this without torch.
"""
from __future__ import annotations

import math
import random

MAX_OPERAND = 19  # a, b in 0..MAX_OPERAND
EOS = "<eos>"
PAD = "<pad>"
SPLIT_SEED = 0
N_EVAL = 100


def prompt(a: int, b: int) -> str:
    """The prompt text for a + b, e.g. prompt(12, 7) == "12+7="."""
    return f"{a}+{b}="


def answer(a: int, b: int) -> str:
    """The target completion text (without EOS), e.g. answer(12, 7) == "19"."""
    return str(a + b)


def all_rows() -> list[dict]:
    """Every prompt of the task as {"input", "answer"} rows, in (a, b) order."""
    n = MAX_OPERAND + 1
    return [{"input": prompt(a, b), "answer": answer(a, b)} for a in range(n) for b in range(n)]


def make_split(seed: int = SPLIT_SEED, n_eval: int = N_EVAL) -> tuple[list[dict], list[dict]]:
    """Shuffle all (a, b) pairs with `seed`; return (train, eval) row lists, disjoint by prompt.

    Default: 300 train / 100 eval. Commuted pairs ("3+5=" vs "5+3=") may land on different
    sides; that is intended, it is part of what makes the held-out set half-knowable.
    """
    rows = all_rows()
    random.Random(seed).shuffle(rows)
    return rows[n_eval:], rows[:n_eval]


def _answer_text(completion: str) -> str:
    """The completion up to the first EOS (or PAD) marker, stripped of whitespace."""
    return completion.split(EOS)[0].split(PAD)[0].strip()


def score(completion: str, answer: str) -> float:
    """0/1 correctness: 1.0 iff the completion, up to EOS and stripped, equals `answer`."""
    return 1.0 if _answer_text(completion) == str(answer).strip() else 0.0


def trace_reward(completion: str, answer: str) -> float:
    """Graded reward in [0, 1] for labeled traces.

    r = 1.0 if correct; 0.4 * exp(-|pred - ans| / 3) (< 0.29) for a wrong integer;
    0.0 if the completion is not an integer. Wrong answers therefore always stay below 0.5.
    """
    if score(completion, answer) == 1.0:
        return 1.0
    text = _answer_text(completion)
    if not text.isascii() or not text.isdigit():
        return 0.0
    return 0.4 * math.exp(-abs(int(text) - int(answer)) / 3.0)


def correctness_reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """Batched 0/1 reward in the TRL reward-function convention (columns arrive as kwargs)."""
    return [score(c, a) for c, a in zip(completions, answer)]
