"""Chat templates rendered as transformers' `apply_chat_template` renders them, with jinja2 alone:
the same sandboxed environment (trimmed blocks, loop controls, the `{% generation %}` tag, its
`tojson`, `raise_exception` and `strftime_now`), the same choice among named templates, and the
same cut of a continued final message. preftune.model.tokenizer tokenizes what comes out."""
from __future__ import annotations

import copy
import inspect
import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def read_templates(folder: Path, cfg: dict):
    """A folder's templates: its .jinja files override tokenizer_config's entry; one default file
    is a plain string, several templates a dict by name."""
    files = {"default": folder / "chat_template.jinja"} if (
        folder / "chat_template.jinja").is_file() else {}
    extra = folder / "additional_chat_templates"
    files |= {p.name.removesuffix(".jinja"): p for p in sorted(extra.glob("*.jinja"))}
    if files:
        texts = {k: p.read_text(encoding="utf-8") for k, p in files.items()}
        return texts["default"] if list(texts) == ["default"] else texts
    template = cfg.get("chat_template")
    if isinstance(template, (list, tuple)):
        return {t["name"]: t["template"] for t in template}
    return template


def select(own, name: str | None, tools) -> str:
    """A named template of several ("tool_use" when tools are given, else "default"), the one
    template, or `name` itself as a template's text."""
    if isinstance(own, dict):
        if name is not None and name in own:
            return own[name]
        if name is None:
            key = "tool_use" if tools is not None and "tool_use" in own else "default"
            if key not in own:
                raise ValueError(f"several chat templates and no default: {sorted(own)}")
            return own[key]
    if name is None and own is None:
        raise ValueError("Cannot use chat template functions because "
                         "tokenizer.chat_template is not set")
    return own if name is None else name


def render(template: str, conversation, /, tools=None, documents=None,
           add_generation_prompt: bool = False, continue_final_message: bool | str = False,
           **variables):
    """The text of one conversation, or a list for a batch of them; `variables` are the special
    tokens and the caller's extra keyword arguments."""
    if not conversation:
        raise ValueError("Cannot apply chat template to an empty conversation.")
    batched = isinstance(conversation[0], (list, tuple))
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    if tools is not None:
        tools = [t if isinstance(t, dict) else _schema(t) for t in tools]
    if documents is not None and not all(isinstance(d, dict) for d in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    texts = [_render_one(template, chat, continue_final_message, messages=chat, tools=tools,
                         documents=documents, add_generation_prompt=add_generation_prompt,
                         **variables) for chat in (conversation if batched else [conversation])]
    return texts if batched else texts[0]


def _schema(tool) -> dict:
    """A Python function as a tool: transformers' own JSON schema of it (the one import)."""
    if not (inspect.isfunction(tool) or inspect.ismethod(tool)):
        raise ValueError("Tools should either be a JSON schema, or a callable function with type "
                         "hints and a docstring suitable for auto-conversion to a schema.")
    from transformers.utils import get_json_schema

    return get_json_schema(tool)


def _continued(chat: list, key: str, template: str) -> tuple[list, str]:
    """The conversation with the tag after its final message's text (its last text block), and
    that text."""
    chat = copy.deepcopy(chat)
    if (final := chat[-1].get(key)) is None:
        raise ValueError(f'the final message has no "{key}" to continue')
    if key not in template:
        raise ValueError(f'continue_final_message "{key}" is not a field of the chat_template')
    if isinstance(final, (list, tuple)):
        block = next((b for b in reversed(final) if "text" in b), None)
        if block is None:
            raise ValueError("no text to continue in the final message")
        final, block["text"] = block["text"], block["text"] + CONTINUE_TAG
    else:
        chat[-1][key] = final + CONTINUE_TAG
    return chat, final


def _render_one(template: str, chat: list, cont: bool | str, **variables) -> str:
    """One conversation; a continued final message is cut right after its text, as transformers
    does (by a tag appended to the text, found again in the output)."""
    if cont:
        chat, final = _continued(chat, cont if isinstance(cont, str) else "content", template)
        variables["messages"] = chat
    text = _compiled(template).render(**variables)
    if cont:
        if final.strip() not in text or CONTINUE_TAG.strip() not in text:
            raise ValueError("the final message does not appear in the rendered chat")
        at = text.rindex(CONTINUE_TAG.strip())
        text = text[:at] if text[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else text[:at].rstrip()
    return text


class _Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` renders its body (transformers tracks where the
    assistant's text lies with it; preftune never asks for that mask)."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller) -> str:
        return caller()


def _raise(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """jinja's own tojson escapes HTML characters; the templates expect plain JSON."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


@lru_cache(maxsize=32)
def _compiled(source: str) -> jinja2.Template:
    """The environment transformers renders chat templates in: sandboxed, trimmed blocks,
    loop controls, the generation tag, its tojson and globals."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
