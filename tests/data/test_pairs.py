import os

import pyarrow.parquet as pq
import pytest

from preftune.data.pairs import Pair, build_pairs, read_pairs, write_pairs
from preftune.data.traces import Trace
from preftune.errors import UserError
from tests.data import write_jsonl, write_parquet


def traces(*triples):
    return [Trace(p, r, s, "t.jsonl", i) for i, (p, r, s) in enumerate(triples)]


DATA = traces(
    ("p1", "good", 0.9), ("p1", "best", 1.0), ("p1", "bad", 0.2), ("p1", "worst", 0.0), ("p1", "mid", 0.6),
    ("p2", "ok", 0.8), ("p2", "meh", 0.6),  # no rejected
    ("p3", "low", 0.1),  # no chosen
    ("p4", "x", 0.4), ("p4", "y", 0.7),
)


def test_best_vs_worst_one_pair_per_prompt():
    pairs, report = build_pairs(DATA)
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [("p1", "best", "worst"), ("p4", "y", "x")]
    assert pairs[0].margin == pytest.approx(1.0) and pairs[1].chosen_reward == 0.7
    assert (report.prompts_seen, report.prompts_without_chosen, report.prompts_without_rejected) == (4, 1, 1)
    assert (report.pairs_made, report.prompts_with_pairs) == (2, 2)


def test_prompt_without_both_counted_in_both():
    _, report = build_pairs(traces(("p", "m", 0.6)))
    assert (report.prompts_without_chosen, report.prompts_without_rejected, report.pairs_made) == (1, 1, 0)


def test_thresholds_are_chosen_ge_and_rejected_lt():
    pairs, _ = build_pairs(traces(("p", "a", 0.7), ("p", "b", 0.5), ("p", "c", 0.49)))
    assert [(p.chosen, p.rejected) for p in pairs] == [("a", "c")]


def test_all_pairs_margin_order_and_cap():
    pairs, report = build_pairs(DATA, strategy="all_pairs")
    p1 = [(p.chosen, p.rejected) for p in pairs if p.prompt == "p1"]
    # margins: best-worst 1.0, good-worst 0.9, best-bad 0.8, good-bad 0.7
    assert p1 == [("best", "worst"), ("good", "worst"), ("best", "bad"), ("good", "bad")]
    margins = [p.margin for p in pairs if p.prompt == "p1"]
    assert margins == sorted(margins, reverse=True)
    capped, report = build_pairs(DATA, strategy="all_pairs", max_pairs_per_prompt=2)
    assert [(p.chosen, p.rejected) for p in capped if p.prompt == "p1"] == p1[:2]
    assert report.skipped_by_cap == 2 and report.pairs_made == 3


def test_min_margin_skips_and_counts():
    pairs, report = build_pairs(DATA, strategy="all_pairs", min_margin=0.75)
    assert [(p.chosen, p.rejected) for p in pairs] == [("best", "worst"), ("good", "worst"), ("best", "bad")]
    assert report.skipped_by_margin == 2  # good-bad 0.7, y-x 0.3
    pairs, report = build_pairs(DATA, min_margin=0.5)
    assert [p.prompt for p in pairs] == ["p1"] and report.skipped_by_margin == 1


def test_ties_broken_by_load_order():
    data = traces(("p", "c1", 0.9), ("p", "r1", 0.1), ("p", "c2", 0.9), ("p", "r2", 0.1))
    pairs, _ = build_pairs(data)
    assert (pairs[0].chosen, pairs[0].rejected) == ("c1", "r1")
    pairs, _ = build_pairs(data, strategy="all_pairs")
    assert [(p.chosen, p.rejected) for p in pairs] == [("c1", "r1"), ("c1", "r2"), ("c2", "r1"), ("c2", "r2")]
    # Reversing the load order reverses the winners.
    pairs, _ = build_pairs(list(reversed(data)))
    assert (pairs[0].chosen, pairs[0].rejected) == ("c2", "r2")


def test_identical_chosen_and_rejected_skipped():
    pairs, report = build_pairs(traces(("p", "same", 0.9), ("p", "same", 0.1)))
    assert pairs == [] and report.skipped_identical == 1


def test_chat_prompts_group_together():
    chat = [{"role": "user", "content": "q"}]
    data = [Trace([dict(m) for m in chat], "a", 0.9, "f", 0), Trace("q", "b", 0.1, "f", 1),
            Trace([dict(m) for m in chat], "c", 0.2, "f", 2)]
    pairs, report = build_pairs(data)
    assert report.prompts_seen == 2
    assert [(p.prompt, p.chosen, p.rejected) for p in pairs] == [(chat, "a", "c")]


@pytest.mark.parametrize("kwargs", [dict(strategy="random"), dict(chosen_min=0.4, rejected_max=0.5),
                                    dict(max_pairs_per_prompt=0), dict(min_margin=-1.0)])
def test_bad_pair_options(kwargs):
    with pytest.raises(UserError):
        build_pairs(DATA, **kwargs)


def test_write_read_round_trip(tmp_path):
    pairs, _ = build_pairs(DATA, strategy="all_pairs")
    out = tmp_path / "sub" / "pairs.parquet"
    write_pairs(pairs, str(out))
    assert pq.read_schema(out).names == ["prompt", "chosen", "rejected", "chosen_reward", "rejected_reward"]
    assert read_pairs(str(out)) == pairs
    assert os.listdir(out.parent) == ["pairs.parquet"]  # no temp file left behind


def test_write_read_chat_messages(tmp_path):
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u", "name": "bob"}]
    pairs = [Pair(chat, [{"role": "assistant", "content": "y"}], [{"role": "assistant", "content": "n"}],
                  0.9, 0.1)]
    write_pairs(pairs, str(tmp_path / "p.parquet"))
    assert read_pairs(str(tmp_path / "p.parquet")) == pairs


def test_write_is_atomic_on_error(tmp_path, monkeypatch):
    out = tmp_path / "pairs.parquet"
    write_pairs([Pair("p", "a", "b", 1.0, 0.0)], str(out))
    before = out.read_bytes()

    def broken(table, where, *a, **k):
        with open(where, "wb") as f:  # a path: arrow writes natively (see traces.arrow_input)
            f.write(b"partial")
        raise OSError("disk full")

    import pyarrow.parquet as pq  # write_pairs imports it when it writes (a jsonl run never does)

    monkeypatch.setattr(pq, "write_table", broken)
    with pytest.raises(OSError):
        write_pairs([Pair("q", "c", "d", 1.0, 0.0)], str(out))
    assert out.read_bytes() == before and os.listdir(tmp_path) == ["pairs.parquet"]
    with pytest.raises(OSError):
        write_pairs([Pair("q", "c", "d", 1.0, 0.0)], str(tmp_path / "new.parquet"))
    assert os.listdir(tmp_path) == ["pairs.parquet"]


def test_write_mixed_prompt_types_is_user_error(tmp_path):
    pairs = [Pair("p", "a", "b"), Pair([{"role": "user", "content": "q"}], "a", "b")]
    with pytest.raises(UserError, match="mixes"):
        write_pairs(pairs, str(tmp_path / "p.parquet"))
    assert os.listdir(tmp_path) == []


def test_read_pairs_trl_format_without_rewards(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}])
    assert read_pairs(str(path)) == [Pair("p", "a", "b", None, None)]


@pytest.mark.parametrize("row,match", [
    ({"prompt": "p", "chosen": "", "rejected": "b"}, r"p\.jsonl row 1 column chosen: response is empty"),
    ({"prompt": "p", "chosen": "a", "rejected": 3}, r"p\.jsonl row 1 column rejected: "),
    ({"prompt": "p", "chosen": "a", "rejected": "b", "chosen_reward": "x"}, r"row 1 column chosen_reward"),
])
def test_read_pairs_row_errors(tmp_path, row, match):
    path = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "p", "chosen": "a", "rejected": "b"}, row])
    with pytest.raises(UserError, match=match):
        read_pairs(str(path))


def test_read_pairs_missing_column(tmp_path):
    path = write_parquet(tmp_path / "p.parquet", [{"prompt": "p", "chosen": "a"}])
    with pytest.raises(UserError, match=r"missing column 'rejected'; columns present: prompt, chosen"):
        read_pairs(str(path))


SKY = [{"role": "user", "content": "What color is the sky?"}]


def test_implicit_prompt_conversations(tmp_path):
    """TRL's implicit-prompt pairs: no prompt column, the shared first messages are the prompt."""
    rows = [{"chosen": SKY + [{"role": "assistant", "content": "Blue."}],
             "rejected": SKY + [{"role": "assistant", "content": "Green."}]}]
    for path in (write_jsonl(tmp_path / "p.jsonl", rows), write_parquet(tmp_path / "p.parquet", rows)):
        (pair,) = read_pairs(str(path))
        assert pair.prompt == SKY
        assert pair.chosen == [{"role": "assistant", "content": "Blue."}]
        assert pair.rejected == [{"role": "assistant", "content": "Green."}]


def test_implicit_prompt_text_keeps_the_space_with_the_responses(tmp_path):
    path = write_jsonl(tmp_path / "p.jsonl", [{"chosen": "The sky is blue.", "rejected": "The sky is green."}])
    assert read_pairs(str(path)) == [Pair("The sky is", " blue.", " green.")]


@pytest.mark.parametrize("row, match", [
    ({"chosen": "abc", "rejected": "xyz"}, "share no prompt"),
    ({"chosen": "abc", "rejected": "abcd"}, "no response"),
    ({"chosen": SKY, "rejected": "text"}, "both be conversations"),
])
def test_implicit_prompt_errors_name_the_row(tmp_path, row, match):
    path = write_jsonl(tmp_path / "p.jsonl", [row])
    with pytest.raises(UserError, match=rf"p\.jsonl row 0: .*{match}"):
        read_pairs(str(path))
