import math

import pytest

from preftune.data.traces import TraceOptions, load_traces, prompt_key
from preftune.errors import UserError
from tests.data import rows, write_csv, write_jsonl, write_parquet

GOOD = rows(("p1", "a", 0.9), ("p1", "b", 0.1), ("p2", "c", 0.5))
CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("name,writer", [
    ("t.parquet", write_parquet), ("t.pq", write_parquet), ("t.jsonl", write_jsonl), ("t.csv", write_csv)])
def test_each_format_reads_rows_in_order(tmp_path, name, writer):
    path = writer(tmp_path / name, GOOD)
    traces, report = load_traces(str(path))
    assert [(t.prompt, t.response, t.reward) for t in traces] == [(r["input"], r["output"], r["final_reward"])
                                                                  for r in GOOD]
    assert [t.row for t in traces] == [0, 1, 2]
    assert all(t.source == str(path) for t in traces)
    assert (report.total_rows, report.kept, sum(report.dropped.values())) == (3, 3, 0)


def test_json_array_file(tmp_path):
    (tmp_path / "t.json").write_text('[{"input": "p", "output": "r", "final_reward": 1}]')
    traces, _ = load_traces(str(tmp_path / "t.json"))
    assert traces[0].reward == 1.0 and isinstance(traces[0].reward, float)


def test_folder_reads_supported_files_sorted_recursively(tmp_path):
    write_jsonl(tmp_path / "b.jsonl", rows(("pb", "r", 0.2)))
    write_parquet(tmp_path / "a.parquet", rows(("pa", "r", 0.1)))
    write_csv(tmp_path / "sub" / "c.csv", rows(("pc", "r", 0.3)))
    (tmp_path / "README.md").write_text("not data")
    (tmp_path / "_SUCCESS.json").write_text("")
    traces, report = load_traces(str(tmp_path))
    assert [t.prompt for t in traces] == ["pa", "pb", "pc"]
    assert report.files == 3 and len(traces.files) == 3


def test_glob(tmp_path):
    write_jsonl(tmp_path / "x1.jsonl", rows(("p1", "r", 0.2)))
    write_jsonl(tmp_path / "x2.jsonl", rows(("p2", "r", 0.2)))
    write_jsonl(tmp_path / "y.jsonl", rows(("p3", "r", 0.2)))
    traces, _ = load_traces(str(tmp_path / "x*.jsonl"))
    assert [t.prompt for t in traces] == ["p1", "p2"]


@pytest.mark.parametrize("make,expect", [
    (lambda d: d / "nope.parquet", "no such file"),
    (lambda d: (d / "empty").mkdir() or d / "empty", "no .parquet"),
    (lambda d: d / "z*.jsonl", "match"),
    (lambda d: (d / "t.txt").write_text("x") and d / "t.txt", "unsupported file type"),
    (lambda d: (d / "t.parquet").write_bytes(b"not parquet") and d / "t.parquet", "cannot read parquet"),
    (lambda d: (d / "t.jsonl").write_text('{"input": 1}\n{oops\n') and d / "t.jsonl", "line 2: invalid JSON"),
])
def test_path_errors_name_the_path(tmp_path, make, expect):
    path = make(tmp_path)
    with pytest.raises(UserError) as e:
        load_traces(str(path))
    msg = str(e.value)
    assert expect in msg and str(path) in msg and "\n" not in msg


def test_missing_column_lists_columns_present(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [{"input": "p", "answer": "r", "final_reward": 0.5}])
    with pytest.raises(UserError, match=r"t\.parquet: missing column 'output'; columns present: input, answer"):
        load_traces(str(path))


def test_custom_column_names(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"q": "p", "a": "r", "score": 3.0}])
    opts = TraceOptions(prompt_column="q", response_column="a", reward_column="score", reward_range=(0, 5))
    traces, _ = load_traces(str(path), opts)
    assert (traces[0].prompt, traces[0].response, traces[0].reward) == ("p", "r", 3.0)


# (bad row, column named in the error, message fragment, drop reason)
BAD_ROWS = [
    ({"input": "p", "output": "r", "final_reward": float("nan")}, "final_reward", "reward is NaN", "nan_reward"),
    ({"input": "p", "output": "r", "final_reward": float("inf")}, "final_reward", "infinite", "infinite_reward"),
    ({"input": "p", "output": "r", "final_reward": 1.5}, "final_reward", "outside reward_range",
     "reward_out_of_range"),
    ({"input": "p", "output": "r", "final_reward": "0.5"}, "final_reward", "must be a number", "bad_reward_type"),
    ({"input": "p", "output": "r", "final_reward": True}, "final_reward", "must be a number", "bad_reward_type"),
    ({"input": "p", "output": "r", "final_reward": None}, "final_reward", "missing", "missing_reward"),
    ({"input": "", "output": "r", "final_reward": 0.5}, "input", "prompt is empty", "empty_prompt"),
    ({"input": "  ", "output": "r", "final_reward": 0.5}, "input", "prompt is empty", "empty_prompt"),
    ({"input": "p", "output": "", "final_reward": 0.5}, "output", "response is empty", "empty_response"),
    ({"input": 7, "output": "r", "final_reward": 0.5}, "input", "string or a list of chat", "bad_prompt_type"),
    ({"input": ["x"], "output": "r", "final_reward": 0.5}, "input", "not chat messages", "bad_prompt_type"),
    ({"input": [], "output": "r", "final_reward": 0.5}, "input", "empty message list", "empty_prompt"),
    ({"input": "p", "output": {"a": 1}, "final_reward": 0.5}, "output", "got dict", "bad_response_type"),
]


@pytest.mark.parametrize("bad,column,fragment,reason", BAD_ROWS)
def test_invalid_row_error_names_file_row_column(tmp_path, bad, column, fragment, reason):
    path = write_jsonl(tmp_path / "t.jsonl", GOOD + [bad])
    with pytest.raises(UserError) as e:
        load_traces(str(path))
    msg = str(e.value)
    assert msg.startswith(f"{path} row 3 column {column}: ") and fragment in msg and "\n" not in msg


@pytest.mark.parametrize("bad,column,fragment,reason", BAD_ROWS)
def test_invalid_row_drop_counts_reason(tmp_path, bad, column, fragment, reason):
    path = write_jsonl(tmp_path / "t.jsonl", [bad] + GOOD + [bad])
    traces, report = load_traces(str(path), TraceOptions(invalid="drop"))
    assert [t.row for t in traces] == [1, 2, 3]
    assert dict(report.dropped) == {reason: 2}
    assert report.total_rows == 5 and report.kept == 3


def test_csv_nan_reward_and_numeric_prompt(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("input,output,final_reward\n123,r,0.5\np,r,nan\n")
    with pytest.raises(UserError, match=r"t\.csv row 1 column final_reward: reward is NaN"):
        load_traces(str(path))
    traces, report = load_traces(str(path), TraceOptions(invalid="drop"))
    assert traces[0].prompt == "123" and report.dropped == {"nan_reward": 1}


def test_parquet_error_names_row(tmp_path):
    path = write_parquet(tmp_path / "traces.parquet", GOOD + rows(("p", "r", -0.1)))
    with pytest.raises(UserError, match=r"traces\.parquet row 3 column final_reward: reward -0\.1 is outside"):
        load_traces(str(path))


def test_reward_range_is_inclusive_and_configurable(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", rows(("p", "a", 0.0), ("p", "b", 1.0), ("p", "c", -2.0)))
    traces, _ = load_traces(str(path), TraceOptions(reward_range=(-math.inf, math.inf)))
    assert len(traces) == 3
    traces, report = load_traces(str(path), TraceOptions(invalid="drop"))
    assert len(traces) == 2 and report.dropped == {"reward_out_of_range": 1}


def test_duplicates_policies_across_files(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", rows(("p", "r", 0.5), ("p", "r", 0.6)))
    write_jsonl(tmp_path / "b.jsonl", rows(("p", "r", 0.5), ("p", "r", 0.5)))
    traces, report = load_traces(str(tmp_path))
    assert [(t.source.endswith("a.jsonl"), t.row) for t in traces] == [(True, 0), (True, 1)]
    assert report.dropped == {"duplicate": 2}
    traces, report = load_traces(str(tmp_path), TraceOptions(duplicates="keep"))
    assert len(traces) == 4 and not report.dropped
    with pytest.raises(UserError, match=r"b\.jsonl row 0 columns input, output, final_reward: "
                                        r"exact duplicate of .*a\.jsonl row 0"):
        load_traces(str(tmp_path), TraceOptions(duplicates="error"))


def test_min_reward_threshold_counted(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", rows(("p", "a", 0.1), ("p", "b", 0.3), ("p", "c", 0.3),
                                                  ("p", "a", 0.1), ("p", "d", float("nan"))))
    traces, report = load_traces(str(path), TraceOptions(min_reward_threshold=0.3, invalid="drop"))
    assert [t.response for t in traces] == ["b", "c"]
    assert report.dropped == {"below_min_reward": 1, "duplicate": 1, "nan_reward": 1}
    assert report.total_rows == report.kept + sum(report.dropped.values())


def test_extra_columns_kept(tmp_path):
    path = write_parquet(tmp_path / "t.parquet", [{"input": "p", "output": "r", "final_reward": 0.5,
                                                   "trace_id": "t-1", "latency": 3}])
    traces, _ = load_traces(str(path))
    assert traces[0].extra == {"trace_id": "t-1", "latency": 3}


def test_chat_messages_same_key_from_parquet_and_jsonl(tmp_path):
    # Parquet unifies struct keys, so the first message gains name=None; it must not change the key.
    chat_rows = [{"input": CHAT, "output": "a", "final_reward": 0.9},
                 {"input": [{"role": "user", "content": "yo", "name": "n"}], "output": "b", "final_reward": 0.1}]
    pq_traces, _ = load_traces(str(write_parquet(tmp_path / "t.parquet", chat_rows)))
    js_traces, _ = load_traces(str(write_jsonl(tmp_path / "t.jsonl", chat_rows)))
    assert pq_traces[0].prompt == CHAT == js_traces[0].prompt
    assert prompt_key(pq_traces[0].prompt) == prompt_key(js_traces[0].prompt) != prompt_key(pq_traces[1].prompt)
    assert prompt_key("hi") == "hi" and prompt_key(CHAT) != prompt_key("hi")


@pytest.mark.parametrize("opts", [TraceOptions(invalid="skip"), TraceOptions(duplicates="nope"),
                                  TraceOptions(reward_range=(1.0, 0.0))])
def test_bad_options(tmp_path, opts):
    path = write_jsonl(tmp_path / "t.jsonl", GOOD)
    with pytest.raises(UserError):
        load_traces(str(path), opts)


def test_empty_json_shard_in_folder_is_fine(tmp_path):
    write_jsonl(tmp_path / "a.jsonl", GOOD)
    (tmp_path / "b.jsonl").write_text("")
    traces, report = load_traces(str(tmp_path))
    assert len(traces) == 3 and report.files == 2
