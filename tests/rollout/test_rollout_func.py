"""A user's rollout_func (TRL 1.16's contract, `rollout/custom.py`): it samples through the run's
engine from token ids; its env_mask leaves the tokens it inserted out of the loss; its extra fields
reach the reward functions; a malformed answer is a UserError naming it."""
from __future__ import annotations

import pytest
import torch

from preftune.config import GRPOConfig
from preftune.data.prompts import PromptSet
from preftune.data.tokenize import PromptTruncation
from preftune.errors import UserError
from preftune.rollout.online import OnlineSource
from preftune.distributed.group import Parallel

INSERT = [70, 71, 72]  # tokens the function adds between two sampled turns (an observation)


def two_turns(prompts, trainer):
    tok, G = trainer.processing_class, trainer.num_generations
    p_ids = [tok(p).input_ids for p in prompts]
    first, lp1 = trainer.generate(p_ids, num_generations=G, max_new_tokens=3)
    rows = [p for p in p_ids for _ in range(G)]
    second, lp2 = trainer.generate([p + c + INSERT for p, c in zip(rows, first)], max_new_tokens=2, turn=1)
    return {"prompt_ids": rows, "completion_ids": [a + INSERT + b for a, b in zip(first, second)],
            "logprobs": [x + [0.0] * 3 + y for x, y in zip(lp1, lp2)],
            "env_mask": [[1] * len(a) + [0] * 3 + [1] * len(b) for a, b in zip(first, second)],
            "turns_seen": [2] * len(rows)}


def seen_reward(prompts, completions, completion_ids, turns_seen, **kw):
    return [float(t) + len(ids) / 100 for t, ids in zip(turns_seen, completion_ids)]


def source(tokenizer, func) -> OnlineSource:
    cfg = GRPOConfig(num_generations=2, max_completion_length=8, prompts_per_step=2)
    return OnlineSource(cfg, tokenizer, PromptSet(["1+1=", "2+2="]), [seen_reward], seed=0, shuffle=False,
                        truncation=PromptTruncation(16), device=torch.device("cpu"), rollout_func=func, dp=Parallel())


def test_a_rollout_func_samples_through_the_engine(model, tokenizer):
    s = source(tokenizer, two_turns).make_batch(model, step=1)
    ro = s.rollout
    assert ro.completion_ids.size(0) == 4 and ro.tool_mask is not None
    for i in range(4):
        n = int(ro.completion_mask[i].sum())
        ids, tm = ro.completion_ids[i, :n].tolist(), ro.tool_mask[i, :n].tolist()
        at = tm.index(0)
        assert ids[at:at + 3] == INSERT and tm[at:at + 3] == [0, 0, 0] and tm.count(0) == 3
    assert (s.total >= 2.0).all()  # the extra field reached the reward
    assert ro.sampling_logps is None  # the own sampler is on-policy


@pytest.mark.parametrize("bad, words", [
    (lambda p, t: {"prompt_ids": []}, "must return a dict with prompt_ids"),
    (lambda p, t: {"prompt_ids": [[1]], "completion_ids": [[2]], "logprobs": [[0.0]]}, "returned 1 prompt_ids"),
    (lambda p, t: {"prompt_ids": [[1]] * 4, "completion_ids": [[2]] * 4, "logprobs": [[0.0]] * 4,
                   "env_mask": [[1, 0]] * 4}, "2 env_mask for 1 completion ids"),
])
def test_a_malformed_answer_names_the_function(model, tokenizer, bad, words):
    with pytest.raises(UserError, match=words):
        source(tokenizer, bad).make_batch(model, step=1)
