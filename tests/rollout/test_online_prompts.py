"""Online prompts: one that renders to no token at all is dropped and counted (issue 25)."""
from __future__ import annotations

from preftune.data.prompts import PromptSet
from preftune.data.tokenize import PromptTruncation
from preftune.rollout.online import encode_prompts


def test_a_prompt_of_zero_tokens_is_dropped_and_counted(tokenizer, caplog):
    assert tokenizer("").input_ids == []  # the embedded tokenizer adds no BOS: "" is no token at all
    prompts = PromptSet(["1+1=", "", "2+2="], {"answer": ["2", "x", "4"]})
    trunc = PromptTruncation(16)
    kept, columns, ids = encode_prompts(tokenizer, prompts, [0, 1, 2, 1], trunc)
    assert kept == ["1+1=", "2+2="] and columns == {"answer": ["2", "4"]} and all(ids)
    assert trunc.dropped == 1 and "prompt 1 renders to 0 tokens" in caplog.text  # counted once though drawn twice
