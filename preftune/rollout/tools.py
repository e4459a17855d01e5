"""Tools and environments for the multi-turn loop (`rollout/agent.py`), with TRL 1.16's contracts.

- A **tool** is a function with type hints and a Google-style docstring; its JSON schema is built
  by `transformers.utils.get_json_schema` (as TRL and the chat templates expect). Sync or async.
- An **environment** is a class: one instance per rollout, `reset(**row) -> str | None` before the
  first turn (a string is appended to the last user message), every other public method a tool,
  an optional `get_reward() -> float` a reward source.
- A **call** is parsed from the sampled text in the model family's format (`FORMATS`); anything
  that goes wrong with it (malformed, unknown tool, wrong arguments, an exception, a timeout)
  becomes an error string the policy reads as the tool's result, and is counted.

Bad input is found at start (`UserError`, exit 78): a tool without type hints or docstring, an
environment without `reset` or whose constructor raises, a template with no tool support.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from preftune.errors import UserError, one_line

FORMATS = ("hermes", "llama3", "glm4")  # config: grpo.tool_call_format (plus "auto")


@dataclass
class Tool:
    name: str
    func: Callable
    schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}


def make_tool(func: Callable, where: str) -> Tool:
    """A tool from a function or bound method; its schema from type hints and docstring."""
    from transformers.utils import get_json_schema

    name = getattr(func, "__name__", type(func).__name__)
    try:
        schema = get_json_schema(func)
    except Exception as e:  # noqa: BLE001 - transformers' TypeHint/Docstring parsing errors
        raise UserError(f"tool '{name}' has no usable schema ({one_line(e)}): "
                        "a tool needs type hints on every argument and a "
                        "Google-style docstring with an Args: section", where=where) from None
    return Tool(name, func, schema)


class EnvironmentClass:
    """One environment class, checked once at start: `reset`, its tools' schemas, whether it has
    `get_reward`; its instances are pooled (constructed once, reset per rollout, as TRL does)."""

    def __init__(self, factory: Callable, where: str):
        self.factory, self.where = factory, where
        probe = self.new()
        cls = type(probe)
        if not callable(getattr(probe, "reset", None)):
            raise UserError(f"environment {cls.__name__} has no reset "
                            "method (reset(**row) -> str | None)", where=where)
        self.name = cls.__name__
        self.methods = [n for n, _ in inspect.getmembers(cls, predicate=inspect.isfunction)
                        if not n.startswith("_") and n not in ("reset", "get_reward")]
        self.has_reward = callable(getattr(probe, "get_reward", None))
        self.schemas = [
            make_tool(getattr(probe, n), f"{where}: {self.name}.{n}").schema for n in self.methods
        ]
        self.pool = [probe]

    def new(self):
        try:
            return self.factory()
        except Exception as e:  # noqa: BLE001 - the user's constructor
            raise UserError(f"the environment's constructor raised: {one_line(e, with_type=True)}",
                            where=self.where) from None


class Environments:
    """`grpo.environment_factory`: one class, or a mapping of names to classes from which each row
    picks by its `environment` column. Every rollout row gets an instance of its own."""

    COLUMN = "environment"

    def __init__(self, factory: Callable | dict[str, Callable],
                 where: str = "grpo.environment_factory"):
        self.where = where
        self.by_name = None if callable(factory) else {
            name: EnvironmentClass(f, f"{where}.{name}") for name, f in factory.items()}
        self.classes = list(self.by_name.values()) if self.by_name else [
            EnvironmentClass(factory, where)]
        self.name = self.classes[0].name if self.by_name is None else self.COLUMN
        self.has_reward = any(c.has_reward for c in self.classes)
        # every class's tools (functions of one name shown once): the prompts' shared rendering;
        # with a mapping each row is rendered again with its own class's (`row_schemas`)
        seen = {}
        for c in self.classes:
            for schema in c.schemas:
                seen.setdefault(schema["function"]["name"], schema)
        self.schemas = list(seen.values())
        self._class_of: dict[int, EnvironmentClass] = {}

    def pick(self, row: dict) -> EnvironmentClass:
        if self.by_name is None:
            return self.classes[0]
        name = row.get(self.COLUMN)
        if name not in self.by_name:
            raise UserError(f"a row's {self.COLUMN} is {name!r}, not one of "
                            f"{', '.join(sorted(self.by_name))}", where=self.where)
        return self.by_name[name]

    def instances(self, rows: list[dict]) -> list:
        """One distinct instance per row, of the row's class (pools grown on demand, then
        reused)."""
        taken: dict[str, int] = {}
        out = []
        for row in rows:
            c = self.pick(row)
            i = taken[c.where] = taken.get(c.where, -1) + 1
            while len(c.pool) <= i:
                c.pool.append(c.new())
            self._class_of[id(c.pool[i])] = c
            out.append(c.pool[i])
        return out

    def of(self, env) -> EnvironmentClass:
        return self._class_of.get(id(env), self.classes[0])

    def tools(self, env) -> dict[str, Tool]:
        c = self.of(env)
        return {n: Tool(n, getattr(env, n), s) for n, s in zip(c.methods, c.schemas)}

    def reward_func(self) -> Callable:
        """`get_reward` as a reward function (TRL: named after the class, weight 1); a row whose
        class has none scores None (not applicable)."""
        def reward(environments=None, **kwargs):
            return [e.get_reward() if self.of(e).has_reward else None for e in environments]

        reward.__name__ = self.name
        return reward


# ---------------------------------------------------------------------------------------------
# the formats


@dataclass
class Call:
    name: str | None
    arguments: dict = field(default_factory=dict)
    error: str | None = None  # a malformed call: what the policy is told


def pick_format(tokenizer, requested: str) -> str:
    """`auto`: the format the chat template writes tool calls in. A template that mentions no tool
    at all cannot show the policy its tools or their results: a UserError."""
    template = (
        tokenizer.chat_template
        if isinstance(getattr(tokenizer, "chat_template", None), str)
        else ""
    )
    if not template or "tool" not in template:
        raise UserError("the chat template has no tool support (it never renders tools or a tool "
                        "turn); "
                        "use a tool-capable model or set its chat_template", where="grpo.tools")
    if requested != "auto":
        return requested
    if "<arg_key>" in template:
        return "glm4"
    if "<tool_call>" in template:
        return "hermes"
    if "<|python_tag|>" in template or "ipython" in template:
        return "llama3"
    raise UserError("cannot tell the tool-call format from the chat template: set "
                    f"grpo.tool_call_format ({', '.join(FORMATS)})", where="grpo.tool_call_format")


def parse_calls(text: str, fmt: str) -> list[Call]:
    """The tool calls written in `text` (one assistant turn, without its stop token): [] for
    none."""
    return {"hermes": _hermes, "llama3": _llama3, "glm4": _glm4}[fmt](text)


def _json_call(body: str, arg_keys=("arguments",)) -> Call:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return Call(None, error=f"malformed tool call (not JSON: {e.msg})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call(None, error="malformed tool call (expected an object with a string 'name')")
    args = next((obj[k] for k in arg_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return Call(obj["name"], error="malformed tool call (arguments are not JSON)")
    if not isinstance(args, dict):
        return Call(obj["name"], error="malformed tool call (arguments must be an object)")
    return Call(obj["name"], args)


def _hermes(text: str) -> list[Call]:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one or more."""
    calls = [_json_call(m.strip()) for m in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S)]
    if text.count("<tool_call>") > len(calls):
        calls.append(Call(None, error="malformed tool call (<tool_call> without </tool_call>)"))
    return calls


def _llama3(text: str) -> list[Call]:
    """Llama 3.1+: the turn is one JSON object `{"name": ..., "parameters": {...}}` (after
    `<|python_tag|>` when the template uses it)."""
    body = text.strip().removeprefix("<|python_tag|>").strip()
    if not body.startswith("{"):
        return []
    return [_json_call(body, ("parameters", "arguments"))]


def _glm4(text: str) -> list[Call]:
    """GLM-4.5: `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>...</tool_call>`; a
    value is JSON when it parses, else a string."""
    out = []
    for body in re.findall(r"<tool_call>(.*?)</tool_call>", text, re.S):
        name, _, rest = body.partition("<arg_key>")
        keys = re.findall(r"<arg_key>(.*?)</arg_key>", "<arg_key>" + rest if rest else "", re.S)
        values = re.findall(r"<arg_value>(.*?)</arg_value>", rest, re.S)
        if not name.strip() or len(keys) != len(values):
            out.append(Call(name.strip() or None,
                            error="malformed tool call (arg_key/arg_value pairs)"))
            continue
        out.append(Call(name.strip(), {k.strip(): _json_or_text(v) for k, v in zip(keys, values)}))
    if text.count("<tool_call>") > len(out):
        out.append(Call(None, error="malformed tool call (<tool_call> without </tool_call>)"))
    return out


def _json_or_text(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


# ---------------------------------------------------------------------------------------------
# running a call


def run_call(call: Call, tools: dict[str, Tool], timeout: float) -> tuple[str, bool]:
    """(the result the policy reads, failed). Never raises and never waits past `timeout`: a tool
    still running then is left to finish in its daemon thread, and its result is dropped."""
    if call.error is not None:
        return _error(call.error), True
    tool = tools.get(call.name)
    if tool is None:
        return _error(
            f"unknown tool '{call.name}'; tools: {', '.join(sorted(tools)) or 'none'}"
        ), True
    try:
        inspect.signature(tool.func).bind(**call.arguments)
    except TypeError as e:
        return _error(f"wrong arguments for tool '{call.name}': {e}"), True
    box: dict = {}

    def target():
        try:
            out = tool.func(**call.arguments)
            box["result"] = asyncio.run(out) if inspect.isawaitable(out) else out
        except BaseException as e:  # noqa: BLE001 - the tool's failure is the policy's to read
            box["error"] = e

    worker = threading.Thread(target=target, daemon=True, name=f"tool-{call.name}")
    worker.start()
    worker.join(timeout)
    if worker.is_alive():
        return _error(f"tool '{call.name}' timed out after {timeout:g}s"), True
    if "error" in box:
        return _error(one_line(box["error"], with_type=True)), True
    return str(box.get("result")), False


def _error(message: str) -> str:
    return str({"error": message})  # TRL's form of a failed call's result
