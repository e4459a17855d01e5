"""eval.split: a deterministic held-out fraction by prompt; training never sees it, evaluation uses it."""
from __future__ import annotations

import json

from preftune.data.prompts import load_prompts
from preftune.data.pipeline import held_out_prompts
from preftune.data.split import drop_held_out, is_held_out, split_prompt_set
from preftune.data.traces import TraceOptions, load_traces
from preftune.evaluation.evaluate import eval_prompt_set
from tests.conftest import TRAIN_PROMPTS, arith_traces, write_parquet


def test_split_is_deterministic_by_prompt_and_near_the_fraction():
    ps = load_prompts(str(TRAIN_PROMPTS))
    held = split_prompt_set(ps, 0.2, held_out=True)
    train = split_prompt_set(ps, 0.2, held_out=False)
    assert len(held) + len(train) == 300 and 40 <= len(held) <= 80
    assert not set(held.prompts) & set(train.prompts)
    assert held.columns["answer"] == [ps.columns["answer"][ps.prompts.index(p)] for p in held.prompts]
    reordered = list(reversed(ps.prompts))
    assert [p for p in reordered if is_held_out(p, 0.2)] == list(reversed(held.prompts))  # order-free
    assert not any(is_held_out(p, 0.0) for p in ps.prompts)
    chat = [{"role": "user", "content": "1+2="}]
    assert is_held_out(chat, 0.5) == is_held_out([{"content": "1+2=", "role": "user", "name": None}], 0.5)


def test_held_out_prompts_of_traces_are_distinct_with_their_columns(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", arith_traces(40))
    held = held_out_prompts(str(path), 0.3, TraceOptions())
    traces, _ = load_traces(str(path))
    kept, n = drop_held_out(list(traces), 0.3)
    assert n == 4 * len(held) and len(kept) + n == 160  # every response of a held-out prompt leaves training
    assert set(held.prompts).isdisjoint(t.prompt for t in kept)
    assert all(str(eval(p[:-1])) == a for p, a in zip(held.prompts, held.columns["answer"]))


def test_training_excludes_and_evaluation_uses_the_held_out_prompts(make_config):
    from preftune.run.loop import train

    cfg = make_config("eval.split=0.25", "max_steps=1")
    prompts = eval_prompt_set(cfg)
    assert prompts is not None and all(is_held_out(p, 0.25) for p in prompts.prompts)
    train(cfg)
    report = json.loads(open(f"{cfg.output_dir}/data_report.json").read())
    assert report["held_out_prompts"] == len(prompts) and report["prompts"] == 300 - len(prompts)
    evals = [json.loads(x) for x in open(f"{cfg.output_dir}/metrics.jsonl") if "eval/reward" in x]
    assert [e["eval/num_prompts"] for e in evals] == [len(prompts)] * 2
