"""Every numeric config key has a declared range (config.BOUNDS), checked at load time: each bound
is tested from both sides, and NaN is refused wherever a float goes."""
from __future__ import annotations

import dataclasses
import math
import typing

import pytest

from preftune.config import BOUNDS, Config, Interval, check_key, load_config
from preftune.errors import UserError


def numeric_keys(cls=Config, prefix: str = "") -> dict[str, type]:
    """Dotted key -> int or float, for every int/float field (optional or list-of included)."""
    out = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out.update(numeric_keys(tp, f"{prefix}{f.name}."))
            continue
        args = typing.get_args(tp) or (tp,)
        flat = [a for arg in args for a in (typing.get_args(arg) or (arg,))]
        for num in (float, int):
            if num in flat and str not in flat:
                out[f"{prefix}{f.name}"] = num
                break
    return out


KEYS = numeric_keys()


def test_every_numeric_key_declares_its_range():
    assert set(KEYS) - set(BOUNDS) == set(), "add the new keys' ranges to config.BOUNDS"
    assert set(BOUNDS) - set(KEYS) == set(), "BOUNDS names a key that is not a numeric config key"


def _is_list(key: str) -> bool:
    section, _, name = key.rpartition(".")
    cls = Config
    for part in filter(None, section.split(".")):
        cls = typing.get_type_hints(cls)[part]
    return "list" in str(typing.get_type_hints(cls)[name])


def cases():
    """(key, value, allowed) around each finite bound of each key."""
    for key, text in BOUNDS.items():
        iv, num = Interval.parse(text), KEYS[key]
        step = 1 if num is int else 1e-3
        if math.isfinite(iv.lo):
            yield key, num(iv.lo), iv.lo_closed
            yield key, num(iv.lo - step), False
            yield key, num(iv.lo + step) if num is float or iv.lo + step < iv.hi else num(iv.lo), True
        if math.isfinite(iv.hi):
            yield key, num(iv.hi), iv.hi_closed
            yield key, num(iv.hi + step), False
        if num is float:
            yield key, float("nan"), False


@pytest.mark.parametrize("key, value, allowed", list(cases()))
def test_bound(key, value, allowed):
    shown = ".nan" if isinstance(value, float) and math.isnan(value) else repr(value)
    override = f"{key}=[{shown}]" if _is_list(key) else f"{key}={shown}"
    if allowed:
        check_key(key, [value] if _is_list(key) else value)
        return
    with pytest.raises(UserError) as info:
        load_config(None, ["data.train=x.jsonl", override])
    where = f"{key}[0]" if _is_list(key) else key
    assert info.value.where == where and f"must be in {BOUNDS[key]}" in str(info.value)


def test_interval_notation():
    iv = Interval.parse("(0, 1]")
    assert 1 in iv and 0.5 in iv and 0 not in iv and float("nan") not in iv
    assert 5 in Interval.parse("[1, inf)") and -1 not in Interval.parse("[0, inf)")
    with pytest.raises(ValueError):
        Interval.parse("0..1")
