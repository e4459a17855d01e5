import json

import pytest

from preftune.data.inspect import format_inspect, inspect_report, pairs_command
from preftune.data.pairs import read_pairs
from preftune.data.traces import TraceOptions
from preftune.errors import UserError
from tests.data import rows, write_jsonl

DATA = rows(
    ("p1", "a", 1.0), ("p1", "b", 0.0), ("p1", "c", 0.5),  # 1 pair; group
    ("p2", "d", 0.8), ("p2", "e", 0.8),  # no rejected; zero spread
    ("p3", "f", 0.2),  # no chosen; too small
    ("p4", "g", 0.9), ("p4", "h", 0.3),  # 1 pair; group
    ("p4", "h", 0.3),  # duplicate
)


@pytest.fixture
def dataset(tmp_path):
    return str(write_jsonl(tmp_path / "t.jsonl", DATA + [{"input": "p5", "output": "i", "final_reward": None}]))


def test_inspect_report_numbers(dataset):
    rep = inspect_report(dataset, TraceOptions(invalid="drop"))
    rewards = [1.0, 0.0, 0.5, 0.8, 0.8, 0.2, 0.9, 0.3]
    assert rep["rows"] == 8 and rep["prompts"] == 4
    assert rep["responses_per_prompt"] == {"1": 1, "2": 2, "3": 1}
    r = rep["reward"]
    assert (r["min"], r["max"], r["count"]) == (0.0, 1.0, 8)
    assert r["mean"] == pytest.approx(sum(rewards) / 8)
    assert r["quantiles"]["p50"] == pytest.approx(0.65)
    assert sum(r["histogram"]["counts"]) == 8 and len(r["histogram"]["edges"]) == 11
    assert r["histogram"]["counts"][0] == 1 and r["histogram"]["counts"][-1] == 2  # 0.0 | 0.9 and 1.0
    assert rep["drops"] == {"files": 1, "total_rows": 10, "kept": 8,
                            "dropped": {"duplicate": 1, "missing_reward": 1}}
    d = rep["dpo"]
    assert (d["pairs_made"], d["prompts_without_chosen"], d["prompts_without_rejected"]) == (2, 1, 1)
    g = rep["grpo"]
    assert (g["groups_made"], g["too_small"], g["zero_spread"]) == (2, 1, 1)
    k = rep["kto"]  # 1.0, 0.8, 0.8, 0.9 desirable; 0.0, 0.2, 0.3 undesirable; 0.5 in between
    assert (k["examples"], k["desirable"], k["undesirable"], k["between_thresholds"]) == (7, 4, 3, 1)
    json.dumps(rep)  # must be JSON-ready for --json


def test_inspect_settings_change_counts(dataset):
    rep = inspect_report(dataset, TraceOptions(invalid="drop"), strategy="all_pairs", min_margin=0.7,
                         min_group_size=3)
    assert rep["dpo"]["pairs_made"] == 1 and rep["dpo"]["skipped_by_margin"] == 1  # p4: 0.9 - 0.3
    assert rep["grpo"]["groups_made"] == 1


def test_format_inspect_text(dataset):
    text = format_inspect(inspect_report(dataset, TraceOptions(invalid="drop")))
    assert "distinct prompts: 4" in text and "dropped missing_reward: 1" in text
    assert "DPO pairs" in text and "GRPO groups" in text and "#" in text
    assert "KTO examples (desirable >= 0.7, undesirable < 0.5): 7 (4 desirable, 3 undesirable; 1 in between" in text


def test_inspect_empty_after_drops(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", rows(("p", "r", 0.1)))
    rep = inspect_report(str(path), TraceOptions(min_reward_threshold=0.5))
    assert rep["rows"] == 0 and rep["reward"] is None
    assert "reward: no rows" in format_inspect(rep)


def test_pairs_command_writes_file_and_report(dataset, tmp_path):
    out = tmp_path / "out" / "pairs.parquet"
    text = pairs_command(dataset, str(out), TraceOptions(invalid="drop"))
    pairs = read_pairs(str(out))
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [("p1", "a", "b"), ("p4", "g", "h")]
    assert "pairs made: 2" in text and "prompts without a chosen response: 1" in text
    assert "dropped duplicate: 1" in text


def test_pairs_command_no_pairs_is_user_error(dataset, tmp_path):
    out = tmp_path / "pairs.parquet"
    with pytest.raises(UserError, match="no DPO pairs"):
        pairs_command(dataset, str(out), TraceOptions(invalid="drop"), chosen_min=1.5, rejected_max=0.5)
    assert not out.exists()
