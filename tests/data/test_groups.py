import pytest

from preftune.data.groups import build_groups
from preftune.data.traces import Trace
from preftune.errors import UserError


def trace(p, r, s, i, **extra):
    return Trace(p, r, s, "t.jsonl", i, extra)


DATA = [
    trace("p2", "a", 0.1, 0, id=1), trace("p1", "b", 0.5, 1), trace("p2", "c", 0.9, 2, id=3),
    trace("p3", "d", 0.4, 3),  # too small
    trace("p1", "e", 0.5, 4), trace("p1", "f", 0.5, 5),  # zero spread
    trace("p4", "g", 1.0, 6), trace("p4", "h", 0.0, 7), trace("p4", "i", 0.5, 8),
]


def test_groups_first_appearance_order_and_exclusions():
    groups, report = build_groups(DATA)
    assert [g.prompt for g in groups] == ["p2", "p4"]
    assert groups[0].responses == ["a", "c"] and groups[0].rewards == [0.1, 0.9]
    assert groups[0].extras == [{"id": 1}, {"id": 3}]
    assert groups[1].responses == ["g", "h", "i"]
    assert (report.prompts_seen, report.groups_made, report.too_small, report.zero_spread) == (4, 2, 1, 1)
    assert report.responses_in_groups == 5


def test_min_size_raises_exclusions():
    groups, report = build_groups(DATA, min_size=3)
    assert [g.prompt for g in groups] == ["p4"]
    assert (report.too_small, report.zero_spread) == (2, 1)


def test_chat_prompts_group_by_content():
    chat = [{"role": "user", "content": "q"}]
    data = [trace(list(chat), "a", 0.0, 0), trace([dict(chat[0])], "b", 1.0, 1)]
    groups, _ = build_groups(data)
    assert len(groups) == 1 and groups[0].prompt == chat


def test_bad_min_size():
    with pytest.raises(UserError):
        build_groups(DATA, min_size=0)
