"""Labeled trace datasets: (prompt, response, reward) rows from parquet / jsonl / csv, local or
fsspec URLs.

A continuous-training pipeline hands us production prompts, the model's responses and a score per
response. This module finds the files, reads them with pyarrow, validates every row and returns the
rows it kept plus a `DropReport` that counts every row it left out, by reason: nothing is dropped
silently.

Row checks, in order: prompt, response, reward (type, null, NaN, infinite, range), then exact
duplicates, then `min_reward_threshold` (rows below it are left out, as in NeMo-RL's preference
datasets). Each failure names the file, the 0-based row within that file and the column in one line.
"""
from __future__ import annotations

import json
import math
import os
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from preftune.config import CHOICES, DataConfig
from preftune.data import in_memory as memory
from preftune.data.messages import is_messages
from preftune.data.tools import TOOLS_COLUMN, drop_nulls, parse_tools
from preftune.errors import UserError, one_line

if TYPE_CHECKING:  # annotations only; arrow is imported where a file is read or written
    import pyarrow as pa

# Extension -> reader. ".json" holds either JSON lines or one JSON array of objects.
FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "json",
           ".json": "json", ".csv": "csv"}
_GLOB_CHARS = "*?["

INVALID_POLICIES = CHOICES["data.invalid"]
DUPLICATE_POLICIES = CHOICES["data.duplicates"]
_DATA = DataConfig()  # the defaults; the config dataclass is their one home


@dataclass
class TraceOptions:
    """How to read a trace dataset: the trace keys of `DataConfig`, with its defaults."""

    prompt_column: str = _DATA.prompt_column
    response_column: str = _DATA.response_column
    reward_column: str = _DATA.reward_column
    reward_range: tuple[float, float] = tuple(_DATA.reward_range)
    # invalid rows: "error" (first one raises) | "drop" (counted by reason)
    invalid: str = _DATA.invalid
    # exact duplicate (prompt, response, reward): "error" | "drop" | "keep"
    duplicates: str = _DATA.duplicates
    # rows with reward < this are left out
    min_reward_threshold: float | None = _DATA.min_reward_threshold

    @classmethod
    def from_config(cls, d: DataConfig) -> "TraceOptions":
        return cls(prompt_column=d.prompt_column, response_column=d.response_column,
                   reward_column=d.reward_column,
                   reward_range=tuple(d.reward_range), invalid=d.invalid,
                   duplicates=d.duplicates, min_reward_threshold=d.min_reward_threshold)


@dataclass
class Trace:
    """One labeled response. `source`/`row` point back at the file and its 0-based row."""

    prompt: Any  # str or list of {role, content} messages
    response: Any  # str or list of messages
    reward: float
    source: str
    row: int
    extra: dict[str, Any] = field(default_factory=dict)  # every other column of the row


class Traces(Sequence[Trace]):
    """The kept rows, in file order then row order, plus the files they came from."""

    def __init__(self, records: list[Trace], files: list[str]):
        self.records = records
        self.files = files

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i):
        return self.records[i]

    def __iter__(self) -> Iterator[Trace]:
        return iter(self.records)


@dataclass
class DropReport:
    """Row accounting: total_rows == kept + sum(dropped.values())."""

    total_rows: int = 0
    kept: int = 0
    dropped: Counter = field(default_factory=Counter)  # reason -> rows, e.g. {"nan_reward": 3}
    files: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"files": self.files, "total_rows": self.total_rows, "kept": self.kept,
                "dropped": dict(sorted(self.dropped.items()))}

    def format(self) -> str:
        lines = [f"rows read: {self.total_rows} from {self.files} file(s); kept {self.kept}"]
        for reason, n in sorted(self.dropped.items()):
            lines.append(f"  dropped {reason}: {n}")
        return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# Prompts / responses as python objects
# ---------------------------------------------------------------------------------------------

def normalize_messages(messages: list[dict]) -> list[dict]:
    """Drop keys whose value is None (inside `tool_calls` too); a turn that only calls tools gets
    `content: ""`.

    Parquet stores messages as list<struct>, which gives every message every key seen in the
    column (absent ones as null); chat templates test `'key' in message`, so nulls must go.
    """
    out = []
    for m in messages:
        m = {k: v for k, v in m.items() if v is not None}
        if "tool_calls" in m:
            m["tool_calls"] = drop_nulls(m["tool_calls"])
            m.setdefault("content", "")
        out.append(m)
    return out


def prompt_key(prompt: Any) -> str:
    """Canonical string for grouping: the string itself, or canonical JSON of the messages."""
    if isinstance(prompt, str):
        return prompt
    return json.dumps(prompt, sort_keys=True, ensure_ascii=False, separators=(",", ":"))


def text_problem(value: Any, what: str) -> tuple[str, str] | None:
    """(reason, message) if `value` is not a usable prompt/response, else None."""
    if value is None:
        return f"empty_{what}", f"{what} is missing (null)"
    if isinstance(value, str):
        return (f"empty_{what}", f"{what} is empty") if not value.strip() else None
    if isinstance(value, list):
        if not value:
            return f"empty_{what}", f"{what} is an empty message list"
        if not is_messages(value) or not all(_text_or_calls(m) for m in value):
            return (f"bad_{what}_type",
                    f"{what} is a list but not chat messages "
                    "(each needs string 'role' and 'content')")
        if not any((m.get("content") or "").strip() or m.get("tool_calls") for m in value):
            return f"empty_{what}", f"{what} messages are all empty"
        return None
    return (
        f"bad_{what}_type",
        f"{what} must be a string or a list of chat messages, got {type(value).__name__}",
    )


def _text_or_calls(message: dict) -> bool:
    """A string content, or no content beside tool calls (an assistant turn that only calls
    tools)."""
    content = message.get("content")
    return isinstance(content, str) or (content is None and bool(message.get("tool_calls")))


def reward_problem(value: Any, lo: float, hi: float) -> tuple[str, str] | None:
    """(reason, message) if `value` is not a finite number inside [lo, hi], else None."""
    if value is None:
        return "missing_reward", "reward is missing (null)"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return (
            "bad_reward_type",
            f"reward must be a number, got {type(value).__name__} {value!r:.40}",
        )
    if math.isnan(value):
        return "nan_reward", "reward is NaN"
    if math.isinf(value):
        return "infinite_reward", "reward is infinite"
    if not lo <= value <= hi:
        return "reward_out_of_range", f"reward {value} is outside reward_range [{lo}, {hi}]"
    return None


# ---------------------------------------------------------------------------------------------
# Finding and reading files
# ---------------------------------------------------------------------------------------------

def _filesystem(path: str):
    """(fs, path-in-fs) for a local path or fsspec URL.

    s3fs (through botocore) reads AWS_ENDPOINT_URL / AWS_ENDPOINT_URL_S3 and the credentials
    itself. Skipping the instance cache keeps a long-lived process from reusing a client built
    for an old endpoint or expired credentials.
    """
    import fsspec  # here: a run that reads nothing through it never pays its import

    try:
        return fsspec.core.url_to_fs(path, skip_instance_cache=True)
    except (ImportError, ValueError) as e:
        raise UserError(f"cannot open filesystem: {one_line(e)}", where=path) from None


def display_path(fs, p: str) -> str:
    """The path as the user would write it (with its protocol for remote files)."""
    return p if is_local(fs) else fs.unstrip_protocol(p)


def is_local(fs) -> bool:
    return "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))


def _supported(p: str) -> bool:
    name = p.rstrip("/").rsplit("/", 1)[-1]
    # Spark/Hadoop write markers such as _SUCCESS and hidden .crc files next to the data.
    return not name.startswith((".", "_")) and os.path.splitext(name)[1].lower() in FORMATS


def resolve_files(path: str) -> tuple[Any, list[str]]:
    """(fs, files): a file, every supported file under a folder (recursive, sorted), or a glob."""
    if memory.is_memory(path):  # a table handed to preftune.train(): one 'file'
        memory.rows(path)
        return memory.FS, [path]
    fs, fpath = _filesystem(str(path))
    try:
        if any(c in fpath for c in _GLOB_CHARS):
            files = sorted(p for p in fs.glob(fpath) if fs.isfile(p) and _supported(p))
            if not files:
                raise UserError("no .parquet/.jsonl/.json/.csv files match this pattern",
                                where=path)
            return fs, files
        if fs.isdir(fpath):
            files = sorted(p for p in fs.find(fpath) if _supported(p))
            if not files:
                raise UserError("folder has no .parquet/.jsonl/.json/.csv files", where=path)
            return fs, files
        if not fs.isfile(fpath):
            raise UserError("no such file or folder", where=path)
    except UserError:
        raise
    except Exception as e:  # network, permissions, credentials
        raise UserError(f"cannot list: {one_line(e)}", where=path) from None
    if os.path.splitext(fpath)[1].lower() not in FORMATS:
        raise UserError(f"unsupported file type; use one of {', '.join(FORMATS)}", where=path)
    return fs, [fpath]


def _read_json_rows(data: bytes, where: str) -> list[dict]:
    """JSON lines (one object per line) or a single JSON array of objects.

    Parsed with the json module rather than pyarrow so that a row whose types differ from the
    others (a string reward, say) becomes a row-level error instead of failing the whole file.
    """
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise UserError(f"line {line}: not UTF-8 text (byte {e.start})", where=where) from None
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"invalid JSON: {e.msg} at line {e.lineno}", where=where) from None
    else:
        rows = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise UserError(f"line {lineno}: invalid JSON: {e.msg}", where=where) from None
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise UserError(f"row {i}: expected a JSON object, got {type(r).__name__}", where=where)
    return rows


def arrow_input(data: bytes) -> pa.BufferReader:
    """`data` copied into arrow-owned memory, as a native input stream.

    Never hand arrow a Python object to read (io.BytesIO, a Python file, or a buffer that references
    a bytes object): arrow's reader threads then take the GIL to read or to drop their reference,
    and a thread still doing so when the interpreter shuts down is ended by CPython with
    pthread_exit, whose unwinding through arrow's noexcept C++ frames calls std::terminate
    ("terminate called without an active exception", exit 134) after the command has answered.
    """
    import pyarrow as pa  # only for parquet and csv: a jsonl run never imports arrow (restart time)

    sink = pa.BufferOutputStream()
    sink.write(data)
    return pa.BufferReader(sink.getvalue())


def _read_table(data: bytes, kind: str, text_columns: Sequence[str] | None) -> pa.Table:
    """text_columns: CSV columns kept as text even when they look like numbers (None = all)."""
    import pyarrow as pa
    import pyarrow.csv as pa_csv
    import pyarrow.parquet as pq

    if kind == "parquet":
        return pq.read_table(arrow_input(data))
    if text_columns is None:
        with pa_csv.open_csv(arrow_input(data)) as reader:  # reads only the first block
            text_columns = reader.schema.names
    # Only "" is null so that "nan"/"inf" rewards parse as floats and are reported as such.
    opts = pa_csv.ConvertOptions(column_types={c: pa.string() for c in text_columns},
                                 null_values=[""], strings_can_be_null=False)
    return pa_csv.read_csv(arrow_input(data), convert_options=opts)


def read_rows(fs, fpath: str,
              text_columns: Sequence[str] | None = ()) -> tuple[list[dict], list[str] | None]:
    """(rows as dicts, column names) of one file. Unreadable file -> UserError naming it.

    Column names are None for a JSON file without rows: it has no schema to check.
    """
    if fs is memory.FS:
        return memory.rows(fpath)
    where = display_path(fs, fpath)
    kind = FORMATS[os.path.splitext(fpath)[1].lower()]
    try:
        with fs.open(fpath, "rb") as f:
            data = f.read()
    except Exception as e:
        raise UserError(f"cannot read file: {one_line(e)}", where=where) from None
    if kind == "json":
        rows = _read_json_rows(data, where)
        return rows, list(dict.fromkeys(k for r in rows for k in r)) if rows else None
    import pyarrow as pa

    try:
        table = _read_table(data, kind, text_columns)
    except (pa.ArrowException, OSError, ValueError) as e:
        raise UserError(f"cannot read {kind}: {one_line(e)}", where=where) from None
    return table.to_pylist(), table.column_names


def require_columns(columns: Sequence[str] | None, needed: Sequence[str], where: str) -> None:
    if columns is None:  # an empty JSON file: nothing to check
        return
    missing = [c for c in needed if c not in columns]
    if missing:
        raise UserError(f"missing column {missing[0]!r}; columns present: "
                        f"{', '.join(columns) or '(none)'}",
                        where=where)


# ---------------------------------------------------------------------------------------------
# Validation and loading
# ---------------------------------------------------------------------------------------------

def _check_options(opts: TraceOptions) -> None:
    if opts.invalid not in INVALID_POLICIES:
        raise UserError(f"invalid must be one of {INVALID_POLICIES}, got {opts.invalid!r}")
    if opts.duplicates not in DUPLICATE_POLICIES:
        raise UserError(f"duplicates must be one of {DUPLICATE_POLICIES}, got {opts.duplicates!r}")
    lo, hi = opts.reward_range
    if not lo <= hi:
        raise UserError("reward_range must be [low, high] with low <= high, got "
                        f"{list(opts.reward_range)}")


def _row_problem(row: dict, opts: TraceOptions) -> tuple[str, str, str] | None:
    """(reason, column, message) for the first problem in a row, else None."""
    for column, what in ((opts.prompt_column, "prompt"), (opts.response_column, "response")):
        problem = text_problem(row.get(column), what)
        if problem:
            return problem[0], column, problem[1]
    problem = reward_problem(row.get(opts.reward_column), *opts.reward_range)
    if problem:
        return problem[0], opts.reward_column, problem[1]
    return None


def _to_trace(row: dict, opts: TraceOptions, where: str, i: int) -> Trace:
    prompt, response = row[opts.prompt_column], row[opts.response_column]
    core = (opts.prompt_column, opts.response_column, opts.reward_column)
    extra = {k: v for k, v in row.items() if k not in core}
    # an agent trace's tool schemas, parsed once (a bad one always raises)
    if TOOLS_COLUMN in extra:
        extra[TOOLS_COLUMN] = parse_tools(extra[TOOLS_COLUMN],
                                          where=f"{where} row {i} column {TOOLS_COLUMN}")
    return Trace(
        prompt=normalize_messages(prompt) if isinstance(prompt, list) else prompt,
        response=normalize_messages(response) if isinstance(response, list) else response,
        reward=float(row[opts.reward_column]), source=where, row=i, extra=extra)


def load_traces(path: str, opts: TraceOptions | None = None) -> tuple[Traces, DropReport]:
    """Read, validate and filter a trace dataset (file, folder, glob or URL).

    Returns the kept rows and the accounting of every row read. With `opts.invalid == "error"`
    the first invalid row raises `UserError("<file> row <i> column <c>: <problem>")`.
    """
    opts = opts or TraceOptions()
    _check_options(opts)
    fs, files = resolve_files(path)
    report = DropReport(files=len(files))
    kept: list[Trace] = []
    seen: dict[tuple, tuple[str, int]] = {}  # duplicate key -> (file, row) of its first copy
    needed = (opts.prompt_column, opts.response_column, opts.reward_column)
    for fpath in files:
        where = display_path(fs, fpath)
        rows, columns = read_rows(fs, fpath, text_columns=needed)
        require_columns(columns, needed, where)
        if _is_csv(fpath):
            _parse_csv_numbers(rows, opts.reward_column)
        for i, row in enumerate(rows):
            report.total_rows += 1
            reason = _drop_reason(row, i, where, opts, seen)
            if reason:
                report.dropped[reason] += 1
            else:
                kept.append(_to_trace(row, opts, where, i))
    report.kept = len(kept)
    return Traces(kept, [display_path(fs, f) for f in files]), report


def _is_csv(fpath: str) -> bool:
    return FORMATS.get(os.path.splitext(fpath)[1].lower()) == "csv"


def _parse_csv_numbers(rows: list[dict], column: str) -> None:
    """CSV cells are text: read the reward column as numbers row by row, so that one text cell
    is reported at its own row (letting arrow infer the column would make every row a string)."""
    for row in rows:
        value = row.get(column)
        if isinstance(value, str) and not value.strip():
            row[column] = None  # an empty cell: a missing reward
        elif isinstance(value, str):
            try:
                row[column] = float(value)
            except ValueError:
                pass  # stays text: reward_problem reports this row


def _drop_reason(row: dict, i: int, where: str, opts: TraceOptions, seen: dict) -> str | None:
    """The drop reason for a row (None = keep); raises for invalid rows under policy "error"."""
    problem = _row_problem(row, opts)
    if problem:
        reason, column, message = problem
        if opts.invalid == "error":
            raise UserError(message, where=f"{where} row {i} column {column}")
        return reason
    reward = float(row[opts.reward_column])
    if opts.duplicates != "keep":
        key = (_key(row[opts.prompt_column]), _key(row[opts.response_column]), reward)
        if key in seen:
            if opts.duplicates == "error":
                first = "{} row {}".format(*seen[key])
                cols = f"{opts.prompt_column}, {opts.response_column}, {opts.reward_column}"
                raise UserError(f"exact duplicate of {first} (set duplicates: drop or keep)",
                                where=f"{where} row {i} columns {cols}")
            return "duplicate"
        seen[key] = (where, i)
    if opts.min_reward_threshold is not None and reward < opts.min_reward_threshold:
        return "below_min_reward"
    return None


def _key(value: Any) -> str:
    return prompt_key(normalize_messages(value) if isinstance(value, list) else value)


# The setting that decides each drop reason, named both ways (config key / `preftune data` flag).
_DROP_KEYS = {"duplicate": "data.duplicates / --duplicates",
              "below_min_reward": "data.min_reward_threshold / --min-reward-threshold"}
_INVALID_KEY = "data.invalid / --invalid"


def dropped_note(drops: DropReport | dict) -> str:
    """'; all N rows were dropped: ...' or '; K of N rows were dropped: ...', naming the settings
    that dropped them, or '' when no row was dropped: for errors that say why nothing is left to
    train on. `drops`: a DropReport or its `as_dict()`."""
    d = drops if isinstance(drops, dict) else drops.as_dict()
    if not d["dropped"]:
        return ""
    parts = [f"{n} {reason} ({_DROP_KEYS.get(reason, _INVALID_KEY)})" for reason,
             n in sorted(d["dropped"].items())]
    dropped = d["total_rows"] - d["kept"]
    head = f"all {d['total_rows']}" if not d["kept"] else f"{dropped} of {d['total_rows']}"
    return f"; {head} rows were dropped: " + ", ".join(parts)
