"""Tool schemas for agent traces: a row's `tools` column or the set's `data.tools` file.

A tool schema is what transformers renders with `apply_chat_template(..., tools=...)`: the
OpenAI function form `{"type": "function", "function": {"name": ..., "description": ...,
"parameters": {JSON schema}}}`. A row's value is a JSON string or a list of such mappings (parquet
stores a list of structs with every key seen in the column, absent ones as null: nulls are
dropped). Anything else is a UserError naming the row and column, whatever `data.invalid` says:
a broken schema is a pipeline bug, not a noisy row.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from preftune.errors import UserError

TOOLS_COLUMN = "tools"


def drop_nulls(value: Any) -> Any:
    """`value` with every None inside mappings left out, at any depth (parquet's absent keys)."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, (list, tuple)):
        return [drop_nulls(v) for v in value]
    return value


def schema_problem(tools: Any) -> str | None:
    """Why `tools` is not a list of function schemas, or None."""
    if not isinstance(tools, list):
        return f"tools must be a JSON list of function schemas, got {type(tools).__name__}"
    for k, tool in enumerate(tools):
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(tool.get("function"), dict)
        ):
            return f'tool {k} is not {{"type": "function", "function": {{...}}}}'
        fn = tool["function"]
        if not isinstance(fn.get("name"), str) or not fn["name"].strip():
            return f"tool {k} has no function name"
        if "parameters" in fn and not isinstance(fn["parameters"], dict):
            return f"tool {k} ({fn['name']}): parameters must be a JSON schema object"
    return None


def parse_tools(value: Any, where: str) -> list[dict] | None:
    """A row's tools (JSON string, list, or null/empty string for none) -> schemas, or a
    UserError."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise UserError(
                f"tools is not valid JSON: {e.msg} at char {e.pos}", where=where
            ) from None
    tools = drop_nulls(list(value) if isinstance(value, tuple) else value)
    problem = schema_problem(tools)
    if problem:
        raise UserError(problem, where=where)
    return tools


def load_tools_file(path: str | None) -> list[dict] | None:
    """`data.tools`: a JSON or YAML file holding a list of function schemas (None: no file)."""
    if not path:
        return None
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise UserError(f"cannot read tools file: {e.strerror}", where="data.tools") from None
    if p.suffix.lower() in (".yaml", ".yml"):
        import yaml  # deferred: only a YAML tools file needs it

        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as e:
            raise UserError(f"invalid YAML: {' '.join(str(e).split())}",
                            where=f"data.tools {path}") from None
    else:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"invalid JSON: {e.msg} at line {e.lineno}",
                            where=f"data.tools {path}") from None
    return parse_tools(value, where=f"data.tools {path}")


def template_source(tokenizer) -> str:
    """The chat template's source text (all named templates when there are several)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    return "\n".join(template.values()) if isinstance(template, dict) else str(template)


def check_tool_template(tokenizer, model: str) -> None:
    """Tools are given: the template must render them (its source mentions `tools`), else stop at
    start naming the model, rather than train on prompts that silently lack the tools."""
    if "tools" not in template_source(tokenizer):
        raise UserError("the rows have tools (a tools column or data.tools) "
                        "but the chat template has no tool support (its source "
                        "never mentions tools); use a tool-capable template", where=model)


def default_tools(tokenizer, path: str | None, model: str, row_tools) -> list[dict] | None:
    """The set's tools (`data.tools`, None without a file), after checking at start that the
    template renders tools when the file or any row (`row_tools`: each row's value) has some."""
    default = load_tools_file(path)
    if default is not None or any(t is not None for t in row_tools):
        check_tool_template(tokenizer, model)
    return default
