"""SFT examples from labeled traces (reward filter), TRL prompt/completion and conversational files:
formats, validation naming file/row/column, counted drops."""
from __future__ import annotations

import pytest

from preftune.data.pipeline import load_examples
from preftune.data.sft import MESSAGES, PROMPT_COMPLETION, TRACES, detect_format
from preftune.data.traces import TraceOptions
from preftune.errors import UserError
from tests.conftest import arith_traces, write_jsonl, write_parquet


def test_traces_keep_responses_at_or_above_min_reward(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", arith_traces(6))  # per prompt: 1 right (1.0), 3 wrong (< 0.5)
    examples, report = load_examples(str(path), TraceOptions(), min_reward=0.7)
    assert detect_format(str(path)) == TRACES
    assert len(examples) == 6 and all(e.prompt.startswith(str(i)) for i, e in enumerate(examples))
    assert [e.completion for e in examples] == [str(2 * i + 1) for i in range(6)]
    assert report["sft"] == {"examples": 6, "below_min_reward": 18} and report["traces"]["kept"] == 24
    more, report = load_examples(str(path), TraceOptions(), min_reward=0.0)
    assert len(more) == 24 and report["sft"]["below_min_reward"] == 0


def test_no_response_above_the_threshold_is_an_error(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", arith_traces(2))
    with pytest.raises(UserError, match="sft.min_reward=1.5"):
        load_examples(str(path), TraceOptions(), min_reward=1.5)


def test_prompt_completion_format_with_strings_and_messages(tmp_path):
    rows = [{"prompt": "1+1=", "completion": "2"},
            {"prompt": [{"role": "user", "content": "2+2="}], "completion": [{"role": "assistant", "content": "4"}]}]
    path = write_jsonl(tmp_path / "pc.jsonl", rows)
    examples, report = load_examples(str(path), TraceOptions(), min_reward=0.7)
    assert detect_format(str(path)) == PROMPT_COMPLETION
    assert examples[0].prompt == "1+1=" and examples[0].completion == "2"
    assert examples[1].prompt == [{"role": "user", "content": "2+2="}]
    assert report["rows"]["kept"] == 2 and report["format"] == PROMPT_COMPLETION


def test_messages_format_last_assistant_turn_is_the_completion(tmp_path):
    conv = [{"role": "system", "content": "add"}, {"role": "user", "content": "3+4="},
            {"role": "assistant", "content": "7"}]
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": conv}, {"messages": conv}])
    examples, report = load_examples(str(path), TraceOptions(), min_reward=0.7)
    assert detect_format(str(path)) == MESSAGES
    assert len(examples) == 1 and report["rows"]["dropped"] == {"duplicate": 1}  # data.duplicates: drop
    assert examples[0].prompt == conv[:2] and examples[0].completion == conv[2:]
    kept, _ = load_examples(str(path), TraceOptions(duplicates="keep"), min_reward=0.7)
    assert len(kept) == 2


def test_invalid_rows_name_file_row_and_column_or_are_counted(tmp_path):
    rows = [{"prompt": "1+1=", "completion": "2"}, {"prompt": "2+2=", "completion": "  "}, {"prompt": 5, "completion": "x"}]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(UserError) as info:
        load_examples(str(path), TraceOptions(), min_reward=0.7)
    assert str(info.value) == f"{path} row 1 column completion: completion is empty"
    examples, report = load_examples(str(path), TraceOptions(invalid="drop"), min_reward=0.7)
    assert len(examples) == 1
    assert report["rows"] == {"files": 1, "total_rows": 3, "kept": 1,
                              "dropped": {"bad_prompt_type": 1, "empty_completion": 1}}


def test_a_conversation_must_end_with_an_assistant_turn(tmp_path):
    path = write_jsonl(tmp_path / "m.jsonl", [{"messages": [{"role": "user", "content": "3+4="}]}])
    with pytest.raises(UserError, match="row 0 column messages: .*end with an assistant turn"):
        load_examples(str(path), TraceOptions(), min_reward=0.7)
