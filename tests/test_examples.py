"""The shipped demo artifacts (examples/model, examples/data) load and match the task's format."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODEL = EXAMPLES / "model"
DATA = EXAMPLES / "data"


def _load_arith():
    spec = importlib.util.spec_from_file_location("examples_arith", EXAMPLES / "arith.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


arith = _load_arith()


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL)


@pytest.fixture(scope="module")
def model():
    return AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)


def test_tokenizer_is_char_level_and_round_trips(tok):
    text = "12+7=19 Hello, world!\n\t~{}  "
    ids = tok(text)["input_ids"]
    assert len(ids) == len(text)  # one token per ASCII character, no BOS/EOS added
    assert tok.decode(ids) == text
    assert tok.decode(tok("héllo €")["input_ids"]) == "héllo €"  # byte fallback is lossless


def test_auto_tokenizer_matches_raw_tokenizer_json(tok):
    # transformers 5 loads qwen2 checkpoints through Qwen2Tokenizer, which rebuilds the pipeline;
    # the shipped tokenizer.json must tokenize identically either way.
    raw = Tokenizer.from_file(str(MODEL / "tokenizer.json"))
    for text in ["3+4=", "a  b\n\tc", "x<eos>y", "héllo €"]:
        assert tok(text)["input_ids"] == raw.encode(text).ids


def test_tokenizer_special_ids(tok):
    assert tok.eos_token == "<eos>" and tok.pad_token == "<pad>"
    assert tok.eos_token_id is not None and tok.pad_token_id is not None
    assert tok.eos_token_id != tok.pad_token_id
    assert tok("<eos>")["input_ids"] == [tok.eos_token_id]


def test_chat_template_renders_plain_text(tok):
    msgs = [{"role": "user", "content": "12+7="}]
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == "12+7="
    full = msgs + [{"role": "assistant", "content": "19"}]
    assert tok.apply_chat_template(full, tokenize=False) == "12+7=19<eos>"


def test_model_config_matches_tokenizer(model, tok):
    cfg = model.config
    assert cfg.vocab_size == len(tok)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    assert cfg.tie_word_embeddings
    n_params = sum(p.numel() for p in model.parameters())
    assert 0.5e6 < n_params < 2e6


def test_model_forward_and_generation_format(model, tok):
    enc = tok(["3+4="], return_tensors="pt")
    with torch.no_grad():
        logits = model(**enc).logits  # (1, T, V)
        out = model.generate(**enc, max_new_tokens=4, do_sample=False,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    assert logits.shape == (1, 4, len(tok)) and torch.isfinite(logits).all()
    completion = tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert completion.isdigit()  # SFT taught the format: digits then EOS


def test_prompt_files_columns_and_disjoint():
    train, evals = _read_jsonl(DATA / "train_prompts.jsonl"), _read_jsonl(DATA / "eval_prompts.jsonl")
    for row in train + evals:
        assert set(row) == {"input", "answer"}
        a, b = map(int, row["input"].rstrip("=").split("+"))
        assert row["input"] == arith.prompt(a, b) and row["answer"] == str(a + b)
    assert not {r["input"] for r in train} & {r["input"] for r in evals}
    assert len(train) + len(evals) == len({r["input"] for r in train + evals}) == 400


def test_prompt_files_match_make_split():
    train, evals = arith.make_split()
    assert _read_jsonl(DATA / "train_prompts.jsonl") == train
    assert _read_jsonl(DATA / "eval_prompts.jsonl") == evals


def test_traces_columns_and_rewards():
    table = pq.read_table(DATA / "traces.parquet")
    assert {"input", "output", "final_reward", "answer"} <= set(table.column_names)
    assert str(table.schema.field("final_reward").type) == "double"
    rows = table.to_pylist()
    train_inputs = {r["input"] for r in _read_jsonl(DATA / "train_prompts.jsonl")}
    for r in rows:
        assert 0.0 <= r["final_reward"] <= 1.0
        assert "<eos>" not in r["output"] and "<pad>" not in r["output"]
        assert r["input"] in train_inputs
        assert math.isclose(r["final_reward"], arith.trace_reward(r["output"], r["answer"]))
    rewards = [r["final_reward"] for r in rows]
    assert max(rewards) == 1.0 and min(rewards) < 0.5  # preference pairs are possible


@pytest.mark.parametrize("completion,expected", [
    ("19", 1.0), (" 19 ", 1.0), ("19<eos><pad>", 1.0), ("19<eos>7", 1.0),
    ("18", 0.0), ("190", 0.0), ("", 0.0), ("1<eos>9", 0.0),
])
def test_score(completion, expected):
    assert arith.score(completion, "19") == expected


def test_trace_reward_is_graded():
    assert arith.trace_reward("19", "19") == 1.0
    near, far = arith.trace_reward("18", "19"), arith.trace_reward("30", "19")
    assert 0.0 < far < near < 0.5
    assert arith.trace_reward("1x", "19") == 0.0 and arith.trace_reward("", "19") == 0.0
    assert arith.correctness_reward(["19", "18"], ["19", "19"]) == [1.0, 0.0]
