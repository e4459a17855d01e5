"""train/evaluate.py: held-out evaluation split over the ranks. Each rank generates and scores its
contiguous share of the prompts only, and the gathered shares summarise exactly as the whole set
evaluated in one process (the 2-process run is in test_distributed.py)."""
from __future__ import annotations

import pytest

from preftune.data.prompts import load_prompts
from preftune.data.tokenize import PromptTruncation
from preftune.distributed.group import Parallel
import preftune.evaluation.evaluate as ev
import preftune.rollout.engine as rollout_engine
from tests.conftest import EXAMPLES


def digit_share(prompts, completions, **_):
    """A dense score (the fraction of digits), so the comparison sees every completion."""
    return [sum(c.isdigit() for c in x) / max(len(x), 1) for x in completions]


def answered(prompts, completions, answer, **_):
    """0/1, and None (not applicable) for a third of the prompts: NaN handling is compared too."""
    return [float(c.strip() == a) if int(a) % 3 else None for c, a in zip(completions, answer)]


FUNCS = [digit_share, answered]


KW = dict(weights=[1.0, 2.0], max_new_tokens=6, batch_size=4, truncation=PromptTruncation(16, "left"))


def scored(model, tokenizer, prompt_set, share=None) -> ev.EvalResult:
    return ev.generate_scored(model, tokenizer, prompt_set, FUNCS, share=share, **KW)


def evaluated(model, tokenizer, prompt_set, dp=None) -> dict:
    return ev.evaluate(model, tokenizer, prompt_set, FUNCS, dp=dp, **KW)


class Gathered:
    """A rank of a world whose other ranks' results are known: `gather` puts this rank's in its place."""

    def __init__(self, rank: int, world: int, parts: list):
        self.parallel, self.parts = Parallel(rank=rank, world=world), parts

    def balanced_share(self, n: int) -> slice:
        return self.parallel.balanced_share(n)

    def together(self, fn):  # Parallel.together's error sharing is tested in test_distributed_unit.py
        return fn()

    def gather(self, obj) -> list:
        return [obj if r == self.parallel.rank else p for r, p in enumerate(self.parts)]


@pytest.fixture(scope="module")
def prompt_set():
    ps = load_prompts(str(EXAMPLES / "data" / "eval_prompts.jsonl"))
    ps.prompts, ps.columns = ps.prompts[:7], {k: v[:7] for k, v in ps.columns.items()}
    return ps


@pytest.mark.parametrize("world", [2, 3, 8])
def test_each_rank_scores_its_share_and_every_rank_summarises_all(world, model, tokenizer, prompt_set, monkeypatch):
    whole = evaluated(model, tokenizer, prompt_set)
    shares = [Parallel(rank=r, world=world).balanced_share(len(prompt_set)) for r in range(world)]
    parts = [scored(model, tokenizer, prompt_set, s) for s in shares]
    assert [p.total.size(0) for p in parts] == [s.stop - s.start for s in shares]  # world 8: one rank has none
    seen = []
    real = rollout_engine.sample  # the own sampler behind the engine interface

    def counted(model, prompt_ids, *a, **k):
        seen.append(prompt_ids.size(0))
        return real(model, prompt_ids, *a, **k)

    monkeypatch.setattr(rollout_engine, "sample", counted)
    for rank in range(world):
        seen.clear()
        out = evaluated(model, tokenizer, prompt_set, Gathered(rank, world, parts))
        assert sum(seen) == shares[rank].stop - shares[rank].start  # only its share was generated
        assert out == pytest.approx(whole, nan_ok=True)
        assert out["eval/num_prompts"] == 7


def test_merged_shares_keep_the_prompt_order(model, tokenizer, prompt_set):
    one = scored(model, tokenizer, prompt_set)
    parts = [scored(model, tokenizer, prompt_set, slice(a, b)) for a, b in ((0, 2), (2, 2), (2, 7))]
    merged = ev.EvalResult.merge(parts)
    assert merged.names == one.names == ["digit_share", "answered"]
    for f in ("total", "per_func", "lengths"):
        assert getattr(merged, f).shape == getattr(one, f).shape
        assert getattr(merged, f).nan_to_num(-1).tolist() == getattr(one, f).nan_to_num(-1).tolist()


def test_a_set_smaller_than_the_world_leaves_ranks_empty():
    empty = ev.EvalResult.empty(1)
    assert ev.EvalResult.merge([empty, empty]).total.shape == (0, 1)
    assert ev.summarize(ev.EvalResult.merge([empty]))["eval/num_prompts"] == 0
