"""Agent traces offline: tool schemas, the multi-turn encoder's ids and masks, and bad input."""
from __future__ import annotations

import json

import pytest

from preftune.data.tokenize import encode_prompt, encode_response
from preftune.data.tools import check_tool_template, default_tools, load_tools_file, parse_tools
from preftune.data.traces import TraceOptions, load_traces
from preftune.data.turns import conversation_ids, encode_row, is_multi_turn
from preftune.errors import UserError
from tests.conftest import EXAMPLES, MODEL_DIR, write_jsonl, write_parquet

AGENT_MODEL = EXAMPLES / "agent_model"
ADD = {"type": "function", "function": {"name": "add", "description": "Add two integers.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


@pytest.fixture(scope="module")
def agent_tok():
    from preftune.model.load import load_tokenizer

    return load_tokenizer(str(AGENT_MODEL))


def call(a: int, b: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "function": {"name": "add", "arguments": {"a": a, "b": b}}}]}


PROMPT = [{"role": "user", "content": "2+3+4="}]
# three assistant turns: two tool calls (the first fails) and the answer
RESPONSE = [call(2, 3), {"role": "tool", "name": "add", "content": "5"},
            call(5, 4), {"role": "tool", "name": "add", "content": "error: try again"},
            {"role": "assistant", "content": "9"}]


def expected_text_and_spans() -> tuple[str, str, list[tuple[str, bool]]]:
    """The agent template's output written out by hand: the prompt, and the completion as
    (text, trained) pieces: each assistant turn's content and its <|im_end|> train, nothing else."""
    head = ("<|im_start|>system\nadd(a:integer,b:integer)\n<|im_end|>\n"
            "<|im_start|>user\n2+3+4=<|im_end|>\n<|im_start|>assistant\n")
    pieces = [('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call><|im_end|>', True),
              ("\n<|im_start|>tool\n<tool_response>5</tool_response><|im_end|>\n<|im_start|>assistant\n", False),
              ('<tool_call>{"name": "add", "arguments": {"a": 5, "b": 4}}</tool_call><|im_end|>', True),
              ("\n<|im_start|>tool\n<tool_response>error: try again</tool_response><|im_end|>\n"
               "<|im_start|>assistant\n", False),
              ("9<|im_end|>", True), ("\n", False)]
    return head, "".join(t for t, _ in pieces), pieces


def test_three_assistant_turns_with_tools_mask_exactly_the_assistant_tokens(agent_tok):
    head, body, pieces = expected_text_and_spans()
    enc = encode_row(agent_tok, PROMPT, RESPONSE, tools=[ADD])
    # independent of the encoder: the whole text tokenised at once, each token labelled by the
    # hand-written piece its characters fall in
    whole = agent_tok(head + body, add_special_tokens=False, return_offsets_mapping=True)
    n_head = len(agent_tok(head, add_special_tokens=False).input_ids)
    bounds, at = [], len(head)
    for text, trained in pieces:
        bounds.append((at, at + len(text), trained))
        at += len(text)
    expected = [next(int(t) for lo, hi, t in bounds if lo <= start < hi)
                for start, _ in whole["offset_mapping"][n_head:]]
    assert enc.prompt == whole["input_ids"][:n_head]
    assert enc.completion == whole["input_ids"][n_head:]
    assert enc.mask == expected
    assert sum(enc.mask) == sum(len(agent_tok(t, add_special_tokens=False).input_ids) for t, k in pieces if k)


def test_each_assistant_turns_stop_token_trains_and_a_tool_turns_does_not(agent_tok):
    enc = encode_row(agent_tok, PROMPT, RESPONSE, tools=[ADD])
    eos = agent_tok.eos_token_id
    stops = [m for t, m in zip(enc.completion, enc.mask) if t == eos]
    assert stops == [1, 0, 1, 0, 1]  # assistant, tool, assistant, tool, assistant
    tool_open = agent_tok.convert_tokens_to_ids("<tool_response>")
    assert {m for t, m in zip(enc.completion, enc.mask) if t == tool_open} == {0}


def test_without_assistant_only_every_completion_token_counts(agent_tok):
    enc = encode_row(agent_tok, PROMPT, RESPONSE, tools=[ADD], assistant_only=False)
    assert enc.mask is None and enc.completion == encode_row(agent_tok, PROMPT, RESPONSE, tools=[ADD]).completion


def test_a_plain_row_encodes_as_before(tokenizer):
    enc = encode_row(tokenizer, "12+7=", [{"role": "assistant", "content": "19"}])
    assert enc.mask is None and not is_multi_turn([{"role": "assistant", "content": "19"}])
    assert enc.prompt == encode_prompt(tokenizer, "12+7=") and enc.completion == encode_response(tokenizer, "19")
    assert is_multi_turn(RESPONSE) and is_multi_turn([call(1, 2)])


def test_a_template_that_rewrites_history_is_a_user_error_naming_it(agent_tok):
    import copy

    tok = copy.deepcopy(agent_tok)
    tok.chat_template = tok.chat_template.replace(  # keep only the last assistant turn's content
        "{%- elif m.content is string %}", "{%- elif m.content is string and loop.last %}")
    with pytest.raises(UserError, match=r"row 3: the chat template of .*agent_model rewrites earlier turns"):
        conversation_ids(tok, PROMPT, RESPONSE[:2] + [{"role": "assistant", "content": "5"}] + [
            {"role": "user", "content": "and 4?"}, {"role": "assistant", "content": "9"}], [ADD], where="row 3")


def test_the_demo_template_has_no_tool_support(tokenizer, agent_tok):
    with pytest.raises(UserError, match=rf"{MODEL_DIR}: the rows have tools .* no tool support"):
        default_tools(tokenizer, None, str(MODEL_DIR), [None, [ADD]])
    assert default_tools(tokenizer, None, str(MODEL_DIR), [None, None]) is None  # no tools: nothing to check
    check_tool_template(agent_tok, str(AGENT_MODEL))


@pytest.mark.parametrize("value, message", [
    ("[{'type': 'function'}", "tools is not valid JSON"),
    ('{"type": "function"}', "tools must be a JSON list"),
    ('[{"name": "add"}]', 'tool 0 is not {"type": "function"'),
    ('[{"type": "function", "function": {"description": "x"}}]', "tool 0 has no function name"),
    ('[{"type": "function", "function": {"name": "f", "parameters": []}}]', "parameters must be a JSON schema"),
])
def test_bad_tools_are_user_errors(value, message):
    with pytest.raises(UserError, match=message):
        parse_tools(value, where="t.jsonl row 2 column tools")


def test_a_bad_tools_cell_stops_the_load_naming_row_and_column_even_when_dropping(tmp_path):
    rows = [{"input": "1+1=", "output": "2", "final_reward": 1.0, "tools": json.dumps([ADD])},
            {"input": "1+2=", "output": "3", "final_reward": 1.0, "tools": "[not json"}]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    with pytest.raises(UserError, match=r"t.jsonl row 1 column tools: tools is not valid JSON"):
        load_traces(str(path), TraceOptions(invalid="drop"))


def test_tools_as_parquet_structs_lose_their_nulls(tmp_path):
    other = {"type": "function", "function": {"name": "neg", "parameters": {
        "type": "object", "properties": {"x": {"type": "integer"}}}}}
    rows = [{"input": "1+1=", "output": [call(1, 1), {"role": "tool", "content": "2"},
                                         {"role": "assistant", "content": "2"}],
             "final_reward": 1.0, "tools": [ADD, other]}]
    traces, _ = load_traces(str(write_parquet(tmp_path / "t.parquet", rows)), TraceOptions())
    assert traces[0].extra["tools"] == [ADD, other]  # parquet's union struct filled absent keys with nulls
    assert traces[0].response[0]["tool_calls"][0]["function"]["arguments"] == {"a": 1, "b": 1}


def test_a_tools_file_json_or_yaml(tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps([ADD]))
    (tmp_path / "tools.yaml").write_text("- type: function\n  function:\n    name: add\n")
    assert load_tools_file(str(tmp_path / "tools.json")) == [ADD]
    assert load_tools_file(str(tmp_path / "tools.yaml")) == [{"type": "function", "function": {"name": "add"}}]
    (tmp_path / "bad.yaml").write_text("name: add\n")
    with pytest.raises(UserError, match="data.tools .*bad.yaml: tools must be a JSON list"):
        load_tools_file(str(tmp_path / "bad.yaml"))


def test_the_embedded_agent_traces_load_and_encode(agent_tok):
    traces, report = load_traces(str(EXAMPLES / "data" / "agent_traces.parquet"), TraceOptions())
    assert report.kept == report.total_rows >= 300
    rewards = {t.reward for t in traces}
    assert 1.0 in rewards and min(rewards) < 0.5
    failed = [t for t in traces if any(m["role"] == "tool" and m["content"].startswith("error") for m in t.response)]
    assert failed and len(failed) < len(traces)
    for t in traces[:20]:
        enc = encode_row(agent_tok, t.prompt, t.response, tools=t.extra["tools"])
        assert 0 < sum(enc.mask) < len(enc.completion) or len(t.response) == 1
        assert len(enc.prompt) + len(enc.completion) <= 256
