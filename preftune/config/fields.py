"""How a config key is declared, and everything derived from that one declaration.

A key is a dataclass field made by `knob`: its type annotation, default, choices, range and one
line of help live there and nowhere else. The checks at load time (`check_section`), the error
messages, the `preftune data` flags and `docs/config.md` (`reference`) all read the field.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any

from preftune.errors import UserError

_NO_DEFAULT = dataclasses.MISSING

# What a change of a key means when a run resumes (or a finished run is started again), against the
# config its checkpoint was saved under (run/resume.py):
# shapes no step: logging, cadence, evaluation, trackers, a larger max_steps; accepted, logged
FREE = "free"
# shapes the steps (loss, lr, sampling, rewards): refused unless resume_with_changes
TRAJECTORY = "trajectory"
# the checkpoint means nothing under another value (model, data order, batch shape): refused
FIXED = "fixed"
ON_RESUME = (FREE, TRAJECTORY, FIXED)


def knob(default: Any = _NO_DEFAULT, help: str = "", *, choices: tuple = (),
         range: str | None = None,
         peer: str | None = None, factory=None, resume: str | None = None) -> Any:
    """A config key. `choices`: the allowed values (of each item, for a list); `range`: an interval
    such as "[0, 1)" ("inf" unbounded) for numbers, each item of a list; `peer`: the key's name in
    TRL, NeMo-RL or verl; `factory` for a mutable default; `resume`: what a change means on a resume
    (FREE, TRAJECTORY, FIXED; None: its section's, see `on_resume`)."""
    if range is not None:
        Interval.parse(range)  # a typo in a declaration fails at import, not at a user's load
    if resume not in (None, *ON_RESUME):
        raise ValueError(f"resume={resume!r}; expected one of {ON_RESUME}")
    meta = {"help": help, "choices": tuple(choices), "range": range, "peer": peer, "resume": resume}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def section(cls, *, resume: str = TRAJECTORY) -> Any:
    """A nested section: a dataclass of keys, its docstring the section's description. `resume`:
    what a change of its keys means on a resume, for each key that does not declare its own."""
    if resume not in ON_RESUME:
        raise ValueError(f"resume={resume!r}; expected one of {ON_RESUME}")
    return field(default_factory=cls, metadata={"section": True, "resume": resume})


def internal(default: Any) -> Any:
    """A field the loader sets (never read from or written to YAML)."""
    return field(default=default, metadata={"internal": True})


@dataclass(frozen=True)
class Interval:
    lo: float
    hi: float
    lo_closed: bool
    hi_closed: bool
    text: str

    @classmethod
    def parse(cls, text: str) -> "Interval":
        m = re.fullmatch(r"\s*([\[(])\s*([^,\s]+)\s*,\s*([^\s\])]+)\s*([\])])\s*", text)
        if not m:
            raise ValueError(f"bad interval {text!r}; expected e.g. '[0, 1)'")
        return cls(float(m[2]), float(m[3]), m[1] == "[", m[4] == "]", text.strip())

    def __contains__(self, v: float) -> bool:  # NaN is in no interval
        above = v >= self.lo if self.lo_closed else v > self.lo
        below = v <= self.hi if self.hi_closed else v < self.hi
        return bool(above and below)


def keys(cls, prefix: str = ""):
    """(dotted key, field, type) of every key below a section class, in declaration order."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        if dataclasses.is_dataclass(hints[f.name]):
            yield from keys(hints[f.name], f"{prefix}{f.name}.")
        else:
            yield f"{prefix}{f.name}", f, hints[f.name]


def on_resume(cls, prefix: str = "", inherited: str = TRAJECTORY) -> dict[str, str]:
    """{dotted key: FREE | TRAJECTORY | FIXED} for every key: its own `resume`, else its section's
    (the innermost that says), else TRAJECTORY, so a key declared without thought is refused on a
    change rather than resumed silently."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("internal"):
            continue
        kind = f.metadata.get("resume") or inherited
        if dataclasses.is_dataclass(hints[f.name]):
            out |= on_resume(hints[f.name], f"{prefix}{f.name}.", kind)
        else:
            out[f"{prefix}{f.name}"] = kind
    return out


def check_value(key: str, f: dataclasses.Field, value: Any) -> None:
    """`value` against the field's choices and range; UserError naming the key (or the list
    item)."""
    choices, text = f.metadata.get("choices"), f.metadata.get("range")
    items = list(enumerate(value)) if isinstance(value, list) else [(None, value)]
    for i, v in items:
        where = key if i is None else f"{key}[{i}]"
        if choices and v not in choices:
            raise UserError(f"'{v}' is not one of {', '.join(choices)}", where=where)
        if (
            text is not None
            and v is not None
            and isinstance(v, (int, float))
            and v not in Interval.parse(text)
        ):
            raise UserError(f"must be in {text}, got {v}", where=where)


def check_section(section_value, prefix: str) -> None:
    """Every key of one config section (a dataclass, e.g. `DataConfig` built from CLI flags)."""
    for key, f, _ in keys(type(section_value), prefix):
        value = section_value
        for part in key[len(prefix):].split("."):
            value = getattr(value, part)
        check_value(key, f, value)


def declared(cls, what: str) -> dict:
    """{dotted key: its declared `what` ("choices" or "range")} for every key that has one."""
    return {key: f.metadata[what] for key, f, _ in keys(cls) if f.metadata.get(what)}


# ---------------------------------------------------------------- YAML <-> dataclass

_SCI_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+")


def _coerce(value: Any, tp: Any, key: str) -> Any:
    """Check/convert one YAML value against a type annotation; raise UserError naming the key."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, arg, key)
            except UserError as e:
                errors.append(e)
        if len(errors) == 1:  # already names the key (or the list item)
            raise errors[0]
        raise UserError(f"{value!r} is not a valid value", where=key)
    if origin is dict:
        key_tp, value_tp = typing.get_args(tp)
        if not isinstance(value, dict):
            raise UserError(f"expected a mapping, got {value!r}", where=key)
        return {
            _coerce(k, key_tp, key): _coerce(v, value_tp, f"{key}.{k}") for k, v in value.items()
        }
    if origin is list:
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, list):
            raise UserError(f"expected a list, got {value!r}", where=key)
        return [_coerce(v, item_tp, f"{key}[{i}]") for i, v in enumerate(value)]
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise UserError(f"expected true or false, got {value!r}", where=key)
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise UserError(f"expected an integer, got {value!r}", where=key)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        # YAML 1.1 reads 1e-5 as a string
        if isinstance(value, str) and _SCI_FLOAT.fullmatch(value.strip()):
            return float(value)
        raise UserError(f"expected a number, got {value!r}", where=key)
    if tp is str:
        if isinstance(value, str):
            return value
        raise UserError(f"expected a string, got {value!r}", where=key)
    raise TypeError(f"unsupported config type {tp} for {key}")


def _unknown_key(key: str, cls, prefix: str) -> UserError:
    """The error for a key `cls` does not have: the nearest spelling, else the valid keys (TRL's
    names were read or answered before, config/trl.py)."""
    valid = [f.name for f in dataclasses.fields(cls) if not f.metadata.get("internal")]
    near = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f"; did you mean '{prefix}{near[0]}'?" if near else f"; valid keys: {', '.join(valid)}"
    return UserError(f"unknown config key '{prefix}{key}'{hint}")


def from_dict(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a nested dict, rejecting unknown keys and wrong types."""
    if not isinstance(data, dict):
        raise UserError(f"expected a mapping, got {data!r}", where=prefix.rstrip(".") or "config")
    hints = typing.get_type_hints(cls)
    fields = {
        f.name: hints[f.name] for f in dataclasses.fields(cls) if not f.metadata.get("internal")
    }
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key(str(key), cls, prefix)
        tp = fields[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = from_dict(tp, value or {}, f"{prefix}{key}.")
        else:
            kwargs[key] = _coerce(value, tp, f"{prefix}{key}")
    return cls(**kwargs)


def to_dict(cfg) -> dict:
    out = {}
    for f in dataclasses.fields(cfg):
        if not f.metadata.get("internal"):
            value = getattr(cfg, f.name)
            out[f.name] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


# ---------------------------------------------------------------- docs/config.md


def _type_name(tp: Any) -> str:
    return re.sub(r"\b(typing|builtins)\.", "",
                  getattr(tp, "__name__", None) if isinstance(tp, type) else str(tp))


def reference(cls) -> str:
    """The configuration reference as Markdown: one table per section, from the declarations."""
    lines = ["# Configuration reference", "",
             "Every key of a preftune config, generated from the config dataclasses (`python -m "
             "preftune.config` rewrites this file; a test checks that it is current). Set a key in "
             "the YAML file or on the command line as `section.key=value`.", "",
             "*On resume*: what changing the key means when a run resumes or a "
             "finished run is started again ([checkpoints.md](checkpoints.md#resume)): "
             "`free` is accepted and logged; `trajectory` shapes the training steps "
             "and is refused (exit 78) unless `resume_with_changes: true`; `fixed` is "
             "refused always (the checkpoint means nothing under another value).", ""]
    default, kinds = cls(), on_resume(cls)
    hints = typing.get_type_hints(cls)
    sections = [("", cls, default)] + [
        (f.name + ".", hints[f.name], getattr(default, f.name))
        for f in dataclasses.fields(cls)
        if f.metadata.get("section")
    ]
    for prefix, sec, value in sections:
        lines += [f"## {prefix.rstrip('.') or 'Top level'}", "",
                  " ".join((sec.__doc__ or "").split()), "",
                  "| key | type | default | allowed | meaning | on resume | TRL / NeMo-RL / verl |",
                  "|---|---|---|---|---|---|---|"]
        for key, f, tp in keys(sec, prefix):
            if prefix == "" and "." in key:
                continue  # nested sections get their own table
            v = value
            for part in key[len(prefix):].split("."):
                v = getattr(v, part)
            m = f.metadata
            allowed = ", ".join(f"`{c}`" for c in m.get("choices") or ()) or (
                f"`{m['range']}`" if m.get("range") else ""
            )
            cells = [f"`{key}`", f"`{_type_name(tp)}`", f"`{json.dumps(v)}`",
                     allowed, m.get("help", ""), f"`{kinds[key]}`", m.get("peer") or ""]
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
    return "\n".join(lines)
