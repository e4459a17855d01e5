"""The shipped agent artifacts (examples/agent_model, examples/data/agent_traces.parquet) are what
examples/make_agent_model.py makes, and fit an agent's few turns."""
from __future__ import annotations

import json
import sys

import pyarrow.parquet as pq
import pytest
from transformers import AutoConfig, AutoTokenizer

from tests.conftest import EXAMPLES

AGENT_MODEL = EXAMPLES / "agent_model"


@pytest.fixture(scope="module")
def make():
    sys.path.insert(0, str(EXAMPLES))  # the script imports its neighbours (arith, make_base_model)
    try:
        import make_agent_model
    finally:
        sys.path.remove(str(EXAMPLES))
    return make_agent_model


def test_the_agent_traces_are_the_scripts(make):
    train = [json.loads(x) for x in (EXAMPLES / "data" / "train_prompts.jsonl").read_text().splitlines() if x]
    want = make.agent_rows(train[:make.PROMPTS])
    got = pq.read_table(EXAMPLES / "data" / "agent_traces.parquet").to_pylist()
    strip = lambda msgs: [{k: v for k, v in m.items() if v is not None} for m in msgs]  # noqa: E731
    assert len(got) == len(want) >= 300
    for g, w in zip(got, want):
        assert strip(g["input"]) == w["input"] and strip(g["output"]) == w["output"]
        assert (g["tools"], g["final_reward"], g["answer"]) == (w["tools"], w["final_reward"], w["answer"])


def test_the_agent_prompt_files_are_the_scripts(make):
    for name, source in (("agent_prompts.jsonl", "train_prompts.jsonl"),
                         ("agent_eval_prompts.jsonl", "eval_prompts.jsonl")):
        rows = [json.loads(x) for x in (EXAMPLES / "data" / source).read_text().splitlines() if x]
        got = [json.loads(x) for x in (EXAMPLES / "data" / name).read_text().splitlines() if x]
        assert got == make.chat_prompts(rows) and got[0]["input"][0]["role"] == "user"


def test_the_agent_model_is_small_with_room_and_a_tool_template(make):
    config = AutoConfig.from_pretrained(AGENT_MODEL)
    tok = AutoTokenizer.from_pretrained(AGENT_MODEL)
    assert config.max_position_embeddings >= 256 and config.vocab_size == len(tok)
    assert sum(p.stat().st_size for p in AGENT_MODEL.iterdir()) < 5 * 2 ** 20
    assert tok.chat_template == make.CHAT_TEMPLATE and "tools" in tok.chat_template
    assert tok.eos_token == "<|im_end|>" and config.eos_token_id == tok.eos_token_id
    for t in make.TOOL_TOKENS:  # one id each, and kept by decoding (a tool-call parser reads them)
        ids = tok(t, add_special_tokens=False).input_ids
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) == t
    text = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tools=[make.ADD_TOOL], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>system\nadd(a:integer,b:integer)\n<|im_end|>\n<|im_start|>user\n1+2=<|im_end|>\n" \
                   "<|im_start|>assistant\n"


def test_the_agent_demo_runs_as_the_readme_says(tmp_path):
    """examples/agent_sft.yaml, then examples/agent.yaml from its final/ (a few steps each)."""
    import preftune

    sft = preftune.train(str(EXAMPLES / "agent_sft.yaml"), overrides={
        "max_steps": 3, "output_dir": str(tmp_path / "agent-sft"), "data.eval": None,
        "log.progress_bar": False})
    grpo = preftune.train(str(EXAMPLES / "agent.yaml"), overrides={
        "max_steps": 2, "save_steps": 0, "output_dir": str(tmp_path / "agent-grpo"),
        "model.name_or_path": str(sft.model_path), "data.eval": None,
        "grpo.prompts_per_step": 2, "grpo.num_generations": 2, "log.progress_bar": False})
    assert grpo.step == 2 and "tools/call_frequency" in grpo.metrics
