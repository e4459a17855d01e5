"""preftune.model.tokenizer against transformers.AutoTokenizer on the same folders, for its generic
TokenizersBackend and its Qwen2Tokenizer (examples/model, examples/agent_model, a BPE with merges
trained here, where the Qwen2 split regex changes the ids): ids, decoding, special tokens, chat
templates (tools, tool calls and results, generation tags, several named templates, a continued
final message), save_pretrained; which class transformers picks and which folders are left to it;
and that it never imports transformers."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pyarrow.parquet as pq
import pytest
import torch
from tokenizers import AddedToken, Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from preftune.model.tokenizer import OWN_CLASS_TYPES, QWEN2_TYPES, Tokenizer
from tests.conftest import EXAMPLES, MODEL_DIR, ROOT

AGENT_DIR = EXAMPLES / "agent_model"

TEXTS = ["hello world", "", " ", "  two  spaces\n\n\tand tabs ", "naïve café 日本語 🙂 Ωmega",
         "<eos>", "a<eos>b<pad>c<unk>", "<|im_start|>user\nhi<|im_end|>\n", "<|im_end|><|im_end|>",
         "don't stop , it 's 3.14 ! ok ?", "x" * 300,
         # where Qwen2's split regex matters: contractions, digits one by one, punctuation runs,
         # newlines and spaces, letters of other scripts, NFC
         "It's THEY'LL we've I'd you're, ok?!... 12345 + 3.14159 = 2024",
         "line one\n\nline two\r\n\r\n   indented\n\t\ttabbed  \n", "   leading and trailing   ",
         "日本語とEnglishの混在 Ωμέγα Привет мир 🙂🙂 e\u0301 cafe\u0301", "a-b_c/d\\e 'quoted' \"dq\"",
         "CamelCaseWords and snake_case_words x=1;y=22;z=333", "<|endoftext|> <|im_start|>"]
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

CHATML = """\
{%- if messages[0].role == 'system' %}{% set system = messages[0].content %}\
{% set rest = messages[1:] %}{% else %}{% set system = 'You are terse.' %}\
{% set rest = messages %}{% endif %}
<|im_start|>system
{{ system }}
{%- if tools %}

# Tools (year {{ strftime_now('%Y')[:2] }}xx)
<tools>
{%- for tool in tools %}
{%- if tool.skip is defined %}{% continue %}{% endif %}
{{ tool | tojson(sort_keys=true) }}
{%- endfor %}
</tools>
Call one with <tool_call>{"name": ..., "arguments": ...}</tool_call>.
{%- endif %}<|im_end|>
{% for m in rest %}
{%- if m.role == 'tool' %}
<|im_start|>user
    {% if m.name %}
<tool_response name="{{ m.name }}">
    {% else %}
<tool_response>
    {% endif %}
{{ m.content }}</tool_response><|im_end|>
{% elif m.role == 'assistant' %}
<|im_start|>assistant
{{ m.content or '' }}
{%- for call in m.tool_calls or [] %}
{%- set f = call.function %}
<tool_call>{"name": {{ f.name | tojson }}, "arguments": \
{{ f.arguments if f.arguments is string else f.arguments | tojson(indent=1) }}}</tool_call>
{%- endfor %}<|im_end|>
{% elif m.role in ('user', 'system') %}
<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% else %}{{ raise_exception('unknown role ' + m.role) }}{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

GENERATION = """{% for m in messages %}{% if m.role == 'assistant' %}\
{% generation %}{{ m.content }}{{ eos_token }}{% endgeneration %}\
{% else %}{{ m.role }}: {{ m.content }}\n{% endif %}{% endfor %}\
{% if add_generation_prompt %}assistant: {% endif %}"""

TOOLS = [{"type": "function", "function": {
    "name": "add", "description": "Add two integers ‹é›.",
    "parameters": {"type": "object", "required": ["a", "b"], "properties": {
        "b": {"type": "integer"}, "a": {"type": "integer", "description": "first <addend>"}}}}},
    {"type": "function", "function": {"name": "hidden"}, "skip": True}]

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "naïve 日本 & <b>"}],
    [{"role": "user", "content": "add 2 and 3"},
     {"role": "assistant", "content": "", "tool_calls": [
         {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}]},
     {"role": "tool", "name": "add", "content": "5"},
     {"role": "assistant", "content": "5"}],
]


def _traces(n: int = 4) -> list[tuple[list, list]]:
    """Agent traces of examples/data whose output calls a tool: (conversation, its tools)."""
    rows = pq.read_table(EXAMPLES / "data" / "agent_traces.parquet").slice(0, 200).to_pylist()
    rows = [r for r in rows if any(m["tool_calls"] for m in r["output"])][:n]
    assert len(rows) == n
    return [(r["input"] + r["output"], json.loads(r["tools"])) for r in rows]


def _tokenizer_json(out, add=(), padding=True) -> None:
    """examples/model's tokenizer.json, with added tokens; without padding, nor post-processor."""
    backend = Backend.from_file(str(MODEL_DIR / "tokenizer.json"))
    backend.add_tokens(list(add))
    doc = json.loads(backend.to_str())
    if not padding:
        doc |= {"padding": None, "post_processor": None}
    (out / "tokenizer.json").write_text(json.dumps(doc))


def _folder(root, name, config, add=(), padding=True, model_type="llama", files=None):
    out = root / name
    out.mkdir()
    _tokenizer_json(out, add, padding)
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if model_type is not None:
        (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    for file, text in (files or {}).items():
        (out / file).parent.mkdir(exist_ok=True)
        (out / file).write_text(text if isinstance(text, str) else json.dumps(text))
    return out


def _trained(out) -> None:
    """A byte-level BPE with merges across what Qwen2's regex splits apart (trained on TEXTS with
    no regex), Qwen's special tokens and tool tags; tokenizer.json as Qwen ships it (a ByteLevel
    post-processor, no padding) but with its own pre-tokenizer and no normalizer, which
    Qwen2Tokenizer replaces; vocab.json and merges.txt beside it."""
    backend = Backend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=QWEN_SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [t for t in TEXTS if "<" not in t] + [CHATML, json.dumps(TOOLS)]
    backend.train_from_iterator(corpus * 3, trainer)
    backend.add_tokens(["<tool_call>", "</tool_call>"])
    backend.save(str(out / "tokenizer.json"))
    doc = json.loads(backend.to_str())["model"]
    (out / "vocab.json").write_text(json.dumps(doc["vocab"]))
    (out / "merges.txt").write_text("#version: 0.2\n" + "".join(
        " ".join(m) + "\n" for m in doc["merges"]))


def _qwen(root, name, config, model_type="qwen2", source=None, files=None):
    """A Qwen2Tokenizer folder: the trained BPE, or `source`'s tokenizer.json."""
    out = root / name
    out.mkdir()
    if source is None:
        _trained(out)
    else:
        shutil.copy(source if source.is_file() else source / "tokenizer.json",
                    out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    if model_type is not None:
        (out / "config.json").write_text(json.dumps({"model_type": model_type}))
    for file, doc in (files or {}).items():
        (out / file).write_text(json.dumps(doc))
    return out


def _qwen_folders(root) -> dict:
    """Qwen2Tokenizer folders: the examples (their model files left out), a Qwen2.5-style config
    (added_tokens_decoder, null bos/unk), the class's own defaults (no eos/unk/pad named: its
    <|endoftext|> is added), add_prefix_space, the legacy special_tokens_map.json."""
    out = {}
    for name, source in (("qwen_model", MODEL_DIR), ("qwen_agent", AGENT_DIR)):
        out[name] = root / name
        out[name].mkdir()
        for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
            shutil.copy(source / f, out[name] / f)
    decoder = {"0": "<|endoftext|>", "1": "<|im_start|>", "2": "<|im_end|>"}
    decoder = {i: {"content": t, "special": True, "lstrip": False, "rstrip": False,
                   "normalized": False, "single_word": False} for i, t in decoder.items()}
    qwen25 = {"tokenizer_class": "Qwen2Tokenizer", "chat_template": CHATML, "bos_token": None,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "unk_token": None,
              "additional_special_tokens": QWEN_SPECIAL[1:], "added_tokens_decoder": decoder,
              "errors": "replace", "split_special_tokens": False, "model_max_length": 131072,
              "clean_up_tokenization_spaces": False, "add_bos_token": False}
    out["qwen_trained"] = _qwen(root, "qwen_trained", qwen25, model_type="qwen3")
    out["qwen_class"] = _qwen(root, "qwen_class", {
        "tokenizer_class": "Qwen2TokenizerFast", "chat_template": CHATML,
        "extra_special_tokens": QWEN_SPECIAL[1:]}, model_type=None, source=MODEL_DIR)
    out["qwen_prefix"] = _qwen(root, "qwen_prefix", {
        "add_prefix_space": True, "eos_token": "<|im_end|>", "padding_side": "left"},
        model_type="qwen2_moe")
    out["qwen_legacy"] = _qwen(root, "qwen_legacy", {
        "tokenizer_class": "PreTrainedTokenizerFast", "additional_special_tokens": ["<x>"]},
        files={"special_tokens_map.json": {"eos_token": {
            "content": "<|im_end|>", "lstrip": False, "rstrip": False, "normalized": False,
            "single_word": False}, "pad_token": "<|endoftext|>", "unk_token": "<tool_call>"}})
    # over 100,000 tokens (transformers then looks for a Mistral regex to patch), no merges; a
    # config.json with no transformers_version (what makes it look further)
    big = json.loads((out["qwen_agent"] / "tokenizer.json").read_text())
    big["model"]["vocab"] |= {f"w{i}": 300 + i for i in range(100_001)}
    (root / "big.json").write_text(json.dumps(big))
    out["qwen_big"] = _qwen(root, "qwen_big", json.loads(
        (AGENT_DIR / "tokenizer_config.json").read_text()), source=root / "big.json")
    out["qwen_nopad"] = _qwen(root, "qwen_nopad", qwen25 | {"pad_token": None})
    out["qwen3_generic"] = _qwen(root, "qwen3_generic", qwen25 | {
        "tokenizer_class": "PreTrainedTokenizerFast"}, model_type="qwen3")
    return out


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tokenizer folders that transformers 5 loads as its generic TokenizersBackend."""
    root = tmp_path_factory.mktemp("tok")
    base = json.loads((MODEL_DIR / "tokenizer_config.json").read_text())
    example = root / "example"  # examples/model's files; its config.json says qwen2 (see below)
    example.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(MODEL_DIR / f, example / f)
    chatml = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHATML,
              "eos_token": "<|im_end|>", "pad_token": "<pad>", "unk_token": "<unk>",
              "extra_special_tokens": ["<|im_start|>", "<|im_end|>"], "model_max_length": 512}
    return {
        "example": example,
        "example_llama": _folder(root, "example_llama", base),
        "chatml": _folder(root, "chatml", chatml),
        # no pad token anywhere (nor tokenizer.json's padding); {% generation %} tags
        "generation": _folder(root, "generation", {
            "tokenizer_class": "TokenizersBackend", "eos_token": "<eos>", "unk_token": "<unk>",
            "bos_token": {"__type": "AddedToken", "content": "<bos>", "special": True,
                          "lstrip": False, "rstrip": False, "normalized": False,
                          "single_word": False},
            "chat_template": GENERATION, "clean_up_tokenization_spaces": True}, padding=False),
        # several named templates; the .jinja files win over the config's entry
        "named": _folder(root, "named", base | {"chat_template": [
            {"name": "default", "template": "D{{ messages[0].content }}"},
            {"name": "tool_use", "template": "T{{ tools | length }}{{ messages[0].content }}"}]}),
        "jinja_file": _folder(root, "jinja_file", base, files={
            "chat_template.jinja": CHATML, "additional_chat_templates/tool_use.jinja": "X"}),
        # the legacy path: special_tokens_map.json, tokenizer.json's added tokens (one named, not
        # special there), added_tokens_decoder absent; a pad from tokenizer.json's padding
        "legacy": _folder(root, "legacy", {"tokenizer_class": "PreTrainedTokenizerFast",
                                           "additional_special_tokens": ["<tool>"]},
                          add=[AddedToken("<|im_end|>", special=False)], model_type=None,
                          files={"special_tokens_map.json": {
                              "eos_token": {"content": "<|im_end|>", "lstrip": False,
                                            "rstrip": False, "normalized": False,
                                            "single_word": False}, "unk_token": "<unk>"}}),
        "decoder_map": _folder(root, "decoder_map", base | {"added_tokens_decoder": {
            "0": {"content": "<pad>", "special": True, "lstrip": False, "rstrip": False,
                  "normalized": False, "single_word": False},
            "259": {"content": "<sep>", "special": False, "lstrip": True, "rstrip": False,
                    "normalized": False, "single_word": False}}, "sep_token": "<sep>"}),
    } | _qwen_folders(root)


@pytest.fixture(scope="module")
def auto():
    from transformers import AutoTokenizer

    return lambda path: AutoTokenizer.from_pretrained(str(path))


def _special_ids(tok) -> list[int]:
    return sorted({i for i in tok.convert_tokens_to_ids(tok.all_special_tokens) if i is not None})


def assert_same(ours: Tokenizer, theirs, cls: str = "TokenizersBackend") -> None:
    """Everything preftune reads from a tokenizer, and the backend state behind it (pre-tokenizer
    and all) for transformers' class `cls`."""
    assert type(theirs).__name__ == cls
    assert len(ours) == len(theirs) and ours.get_vocab() == theirs.get_vocab()
    assert ours.backend_tokenizer.get_added_tokens_decoder() == theirs.added_tokens_decoder
    state = [json.loads(t.backend_tokenizer.to_str()) for t in (ours, theirs)]
    assert [s | {"padding": None} for s in state[:1]] == [s | {"padding": None} for s in state[1:]]
    for name in ("bos", "eos", "unk", "pad"):
        for attr in (f"{name}_token", f"{name}_token_id"):
            assert getattr(ours, attr) == getattr(theirs, attr), attr
    assert ours.special_tokens_map == theirs.special_tokens_map
    assert ours.all_special_tokens == theirs.all_special_tokens
    assert ours.chat_template == theirs.chat_template
    assert ours.padding_side == theirs.padding_side
    assert ours.model_max_length == theirs.model_max_length
    for special in (True, False):
        for text in TEXTS:
            assert ours(text, add_special_tokens=special).input_ids == theirs(
                text, add_special_tokens=special).input_ids, text
            assert ours.encode(text, add_special_tokens=special) == theirs.encode(
                text, add_special_tokens=special)
        assert dict(ours(TEXTS, add_special_tokens=special)) == dict(theirs(
            TEXTS, add_special_tokens=special))
    ids = [theirs(t).input_ids for t in TEXTS] + [_special_ids(theirs) + [5, 40, 41]]
    for skip in (True, False):
        for row in ids:
            assert ours.decode(row, skip_special_tokens=skip) == theirs.decode(
                row, skip_special_tokens=skip)
            assert ours.decode(torch.tensor(row, dtype=torch.long), skip_special_tokens=skip) \
                == theirs.decode(torch.tensor(row, dtype=torch.long), skip_special_tokens=skip)
        assert ours.batch_decode(ids, skip_special_tokens=skip) == theirs.batch_decode(
            ids, skip_special_tokens=skip)
    assert ours.decode(40) == theirs.decode(40)


def _cls(name: str) -> str:
    return "Qwen2Tokenizer" if name.startswith("qwen_") else "TokenizersBackend"


@pytest.mark.parametrize("name", [
    "example_llama", "chatml", "generation", "named", "jinja_file", "legacy", "decoder_map",
    "qwen3_generic", "qwen_model", "qwen_agent", "qwen_trained", "qwen_class", "qwen_prefix",
    "qwen_legacy", "qwen_big"])
def test_same_as_transformers(folders, auto, name):
    ours = Tokenizer.from_folder(folders[name])
    assert ours is not None and ours.name_or_path == str(folders[name])
    assert_same(ours, auto(folders[name]), _cls(name))


def test_example_model_folders(folders, auto):
    """examples/model and examples/agent_model themselves (config.json: qwen2) are transformers'
    Qwen2Tokenizer; examples/model's tokenizer files alone, its generic TokenizersBackend."""
    for folder in (MODEL_DIR, AGENT_DIR):
        assert_same(Tokenizer.from_folder(folder), auto(folder), "Qwen2Tokenizer")
    assert_same(Tokenizer.from_folder(folders["example"]), auto(folders["example"]))


def test_qwen2_split_matters(folders, auto):
    """The trained BPE's merges span what Qwen2's regex splits apart: the file's own pipeline
    gives other ids, Qwen2Tokenizer's (and ours) the same; a default <|endoftext|> is added."""
    folder = folders["qwen_trained"]
    plain = Backend.from_file(str(folder / "tokenizer.json"))
    ours, theirs = Tokenizer.from_folder(folder), auto(folder)
    differ = [t for t in TEXTS if plain.encode(t).ids != ours.encode(t)]
    assert len(differ) > len(TEXTS) // 2
    assert [ours.encode(t) for t in differ] == [theirs.encode(t) for t in differ]
    prefix = Tokenizer.from_folder(folders["qwen_prefix"])
    assert prefix.encode("hi there") != ours.encode("hi there")  # add_prefix_space
    cls = Tokenizer.from_folder(folders["qwen_class"])
    assert cls.eos_token == cls.pad_token == cls.unk_token == "<|endoftext|>"
    assert len(cls) == len(Backend.from_file(str(MODEL_DIR / "tokenizer.json")).get_vocab()) + 3


def _chat_cases():
    cases = [(chat, None) for chat in CHATS] + [(CHATS[0], TOOLS), (CHATS[2], TOOLS)]
    return cases + _traces()


@pytest.mark.parametrize("name", ["chatml", "jinja_file", "example_llama", "qwen_agent",
                                  "qwen_trained", "qwen_class"])
def test_chat_template(folders, auto, name):
    ours, theirs = Tokenizer.from_folder(folders[name]), auto(folders[name])
    for chat, tools in _chat_cases():
        for gen in (False, True):
            kw = dict(add_generation_prompt=gen, **({"tools": tools} if tools else {}))
            text = theirs.apply_chat_template(chat, tokenize=False, **kw)
            assert ours.apply_chat_template(chat, tokenize=False, **kw) == text
            assert dict(ours.apply_chat_template(chat, **kw)) == dict(
                theirs.apply_chat_template(chat, **kw))
            assert ours.apply_chat_template(chat, return_dict=False, **kw) == \
                theirs.apply_chat_template(chat, return_dict=False, **kw)
    batch = [c for c, _ in _chat_cases()[:3]]
    assert ours.apply_chat_template(batch, tokenize=False) == theirs.apply_chat_template(
        batch, tokenize=False)
    assert ours.apply_chat_template(CHATS[1], tokenize=False, custom="v", eos_token="E") == \
        theirs.apply_chat_template(CHATS[1], tokenize=False, custom="v", eos_token="E")


def test_chat_template_details(folders, auto):
    """The tool_use template is picked when tools are given; a callable tool is converted;
    {% generation %} renders its body; a final message continued; a raised template error."""
    ours, theirs = Tokenizer.from_folder(folders["named"]), auto(folders["named"])
    for tools in (None, TOOLS):
        assert ours.apply_chat_template(CHATS[0], tools=tools, tokenize=False) == \
            theirs.apply_chat_template(CHATS[0], tools=tools, tokenize=False)

    def multiply(a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first
            b: the second
        """
        return a * b

    chatml, theirs = Tokenizer.from_folder(folders["chatml"]), auto(folders["chatml"])
    assert chatml.apply_chat_template(CHATS[0], tools=[multiply], tokenize=False) == \
        theirs.apply_chat_template(CHATS[0], tools=[multiply], tokenize=False)
    for chat in CHATS[1:]:
        assert chatml.apply_chat_template(chat[:2], continue_final_message=True,
                                          tokenize=False) == theirs.apply_chat_template(
            chat[:2], continue_final_message=True, tokenize=False)
    bad = [{"role": "robot", "content": "x"}]
    with pytest.raises(Exception, match="unknown role robot") as ours_error:
        chatml.apply_chat_template(bad, tokenize=False)
    with pytest.raises(Exception, match="unknown role robot") as their_error:
        theirs.apply_chat_template(bad, tokenize=False)
    assert type(ours_error.value) is type(their_error.value)
    gen, theirs = Tokenizer.from_folder(folders["generation"]), auto(folders["generation"])
    for chat in CHATS[:2]:
        for flag in (False, True):
            assert gen.apply_chat_template(chat, tokenize=False, add_generation_prompt=flag) == \
                theirs.apply_chat_template(chat, tokenize=False, add_generation_prompt=flag)


def test_template_argument_and_continue(folders, auto):
    """`chat_template=` a name or a text; continue_final_message through a trimming template,
    with another field, and one that loses the message."""
    ours, theirs = Tokenizer.from_folder(folders["named"]), auto(folders["named"])
    chat = [{"role": "user", "content": "a"}, {"role": "assistant", "content": " b  ",
                                              "reasoning": "so "}]
    trim = "{% for m in messages %}{{ m.content | trim }}|{{ m.reasoning }}{% endfor %}"
    for kw in ({"chat_template": "tool_use", "tools": TOOLS}, {"chat_template": trim},
               {"chat_template": trim, "continue_final_message": True},
               {"chat_template": trim, "continue_final_message": "reasoning"}):
        assert ours.apply_chat_template(chat, tokenize=False, **kw) == \
            theirs.apply_chat_template(chat, tokenize=False, **kw), kw
    lose = "{# content #}{% for m in messages %}{{ m.role }}{% endfor %}"
    for tok in (ours, theirs):
        with pytest.raises(ValueError, match="final message"):
            tok.apply_chat_template(chat, tokenize=False, chat_template=lose,
                                    continue_final_message=True)


@pytest.mark.parametrize("name", ["chatml", "qwen_model", "qwen_prefix"])
def test_padding_and_tensors(folders, auto, name):
    """The reward model's call: a right-padded batch as tensors; and the folder's own side."""
    ours, theirs = Tokenizer.from_folder(folders[name]), auto(folders[name])
    fresh = Tokenizer.from_folder(folders[name])  # tokenizer.json pads: not unless asked
    assert fresh(TEXTS).input_ids == theirs(TEXTS).input_ids
    for side in ("right", "left", None):
        a = ours(TEXTS[:6], return_tensors="pt", padding=True, padding_side=side,
                 add_special_tokens=False)
        b = theirs(TEXTS[:6], return_tensors="pt", padding=True, padding_side=side,
                   add_special_tokens=False)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert ours(TEXTS[:3]).input_ids == theirs(TEXTS[:3]).input_ids  # no padding after it


@pytest.mark.parametrize("name", ["generation", "qwen_nopad"])
def test_no_pad_token_then_eos(folders, auto, tmp_path, name):
    """load_tokenizer's `tok.pad_token = tok.eos_token`, kept by save_pretrained."""
    ours, theirs = Tokenizer.from_folder(folders[name]), auto(folders[name])
    assert ours.pad_token is None and ours.pad_token_id is None and theirs.pad_token is None
    ours.pad_token, theirs.pad_token = ours.eos_token, theirs.eos_token
    assert_same(ours, theirs, _cls(name))
    ours.save_pretrained(tmp_path / "out")
    assert_same(Tokenizer.from_folder(tmp_path / "out"), auto(tmp_path / "out"), _cls(name))
    assert auto(tmp_path / "out").pad_token == ours.eos_token


@pytest.mark.parametrize("name", ["chatml", "named", "jinja_file", "legacy", "decoder_map",
                                  "qwen_agent", "qwen_trained", "qwen_class", "qwen_legacy"])
def test_save_pretrained(folders, auto, tmp_path, name):
    """What AutoTokenizer loads from the saved folder equals ours, and the other way round."""
    ours, theirs = Tokenizer.from_folder(folders[name]), auto(folders[name])
    ours.save_pretrained(tmp_path / "out")
    again = auto(tmp_path / "out")
    assert_same(ours, again, _cls(name))
    if _cls(name) == "Qwen2Tokenizer":  # its rebuilt tokenizer.json, as transformers writes it
        theirs.save_pretrained(tmp_path / "theirs")
        assert [json.loads((tmp_path / d / "tokenizer.json").read_text()) for d in (
            "out", "theirs")] == [json.loads((tmp_path / "theirs" / "tokenizer.json").read_text())] * 2
    assert_same(Tokenizer.from_folder(tmp_path / "out"), theirs, _cls(name))
    ours.save_pretrained(folders[name])  # onto its own folder: the files stay
    assert_same(Tokenizer.from_folder(folders[name]), theirs, _cls(name))


def test_clean_up_spaces_not_bpe(tmp_path, auto):
    """clean_up_tokenization_spaces applies to a word-level model (BPE ignores it)."""
    words = ["hello", ",", "world", "!", "it", "'s", "<unk>", "<eos>"]
    backend = Backend(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(tmp_path / "tokenizer.json"))
    for clean in (True, False):
        (tmp_path / "tokenizer_config.json").write_text(json.dumps({
            "tokenizer_class": "TokenizersBackend", "eos_token": "<eos>", "unk_token": "<unk>",
            "clean_up_tokenization_spaces": clean}))
        ours, theirs = Tokenizer.from_folder(tmp_path), auto(tmp_path)
        ids = theirs("hello , world ! it 's <eos>").input_ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == theirs.decode(
                ids, skip_special_tokens=skip)
        assert ours.decode(ids, clean_up_tokenization_spaces=not clean) == theirs.decode(
            ids, clean_up_tokenization_spaces=not clean)


@pytest.mark.parametrize("change", [
    {"tokenizer_class": "Qwen2Tokenizer"}, {"tokenizer_class": "LlamaTokenizerFast"},
    {"auto_map": {"AutoTokenizer": [None, "tok.MyTokenizer"]}}, {"fix_mistral_regex": True},
    {"image_token": "<img>"}, {"model_input_names": ["input_ids"]}, "no tokenizer.json",
    "no tokenizer_class", "qwen3_5", "mistral", "added_tokens.json", "truncation"])
def test_left_to_transformers(folders, tmp_path, change):
    """(Qwen2Tokenizer with a llama config.json is transformers' Qwen2Tokenizer: refused all the
    same, as is any model type not in QWEN2_TYPES.)"""
    folder = tmp_path / "f"
    shutil.copytree(folders["example_llama"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if isinstance(change, dict):
        config |= change
    elif change == "no tokenizer.json":
        (folder / "tokenizer.json").unlink()
    elif change == "no tokenizer_class":
        config.pop("tokenizer_class")
    elif change in ("qwen3_5", "mistral"):
        (folder / "config.json").write_text(json.dumps({"model_type": change}))
    elif change == "added_tokens.json":
        (folder / "added_tokens.json").write_text("{}")
    else:
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        backend.enable_truncation(max_length=8)
        backend.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_folder(folder) is None
    assert Tokenizer.from_folder(tmp_path / "missing") is None


@pytest.mark.parametrize("change", [
    {"model_type": "qwen3_5"}, {"model_type": "qwen3_5", "tokenizer_class": "PreTrainedTokenizerFast"},
    {"model_type": "llama"}, {"model_type": "qwen3", "tokenizer_class": "Qwen3_5Tokenizer"},
    {"fix_mistral_regex": True}, {"add_prefix_space": "yes"}, "truncation", "wordlevel"])
def test_qwen2_left_to_transformers(folders, tmp_path, change):
    """Qwen2Tokenizer folders that transformers reads some other way, or that we do not mirror."""
    folder = tmp_path / "q"
    shutil.copytree(folders["qwen_trained"], folder)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    if isinstance(change, dict):
        if "model_type" in change:
            (folder / "config.json").write_text(json.dumps({"model_type": change["model_type"]}))
        config |= {k: v for k, v in change.items() if k != "model_type"}
    elif change == "truncation":
        backend = Backend.from_file(str(folder / "tokenizer.json"))
        backend.enable_truncation(max_length=8)
        backend.save(str(folder / "tokenizer.json"))
    else:
        Backend(models.WordLevel({"a": 0, "<unk>": 1}, unk_token="<unk>")).save(
            str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_folder(folder) is None


@pytest.mark.parametrize("model_type", [*sorted(QWEN2_TYPES), "llama", "qwen3_5", "mistral", None])
def test_class_choice(folders, auto, tmp_path, model_type):
    """Whichever class AutoTokenizer picks from tokenizer_class and config.json's model type, a
    folder we serve gives the same tokenizer (the pipelines differ: the pick shows); each Qwen
    language model's type is served with every tokenizer_class naming these two classes."""
    for hub in (None, "PreTrainedTokenizerFast", "TokenizersBackend", "Qwen2Tokenizer",
                "Qwen2TokenizerFast"):
        folder = tmp_path / f"{model_type}-{hub}"
        folder.mkdir()
        shutil.copy(folders["qwen_trained"] / "tokenizer.json", folder)
        config = {"eos_token": "<|im_end|>"} | ({"tokenizer_class": hub} if hub else {})
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        if model_type is not None:
            (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
        ours = Tokenizer.from_folder(folder)
        assert ours is not None or model_type not in QWEN2_TYPES, hub
        if ours is not None:
            theirs = auto(folder)
            assert_same(ours, theirs, type(theirs).__name__)


def test_qwen2_types_in_transformers():
    """QWEN2_TYPES are model types transformers maps to Qwen2Tokenizer; among them only qwen2
    overrides a generic tokenizer_class."""
    from transformers.models.auto import tokenization_auto as ta

    qwen2 = {t for t, c in ta.TOKENIZER_MAPPING_NAMES.items() if c == "Qwen2Tokenizer"}
    assert QWEN2_TYPES <= qwen2
    assert QWEN2_TYPES & ta.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS == QWEN2_TYPES & \
        OWN_CLASS_TYPES == {"qwen2"}


def test_own_class_types_cover_transformers():
    """The model types for which AutoTokenizer overrides a generic tokenizer_class (the list is
    kept here to avoid importing transformers; a new transformers may add some)."""
    from transformers.models.auto import tokenization_auto as ta

    generic = (None, "TokenizersBackend", "PythonBackend", "PreTrainedTokenizerFast")
    own = {t for t in ta.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
           if ta.TOKENIZER_MAPPING_NAMES.get(t) not in generic}
    mistral = {t for t, c in ta.TOKENIZER_MAPPING_NAMES.items() if c == "MistralCommonBackend"}
    assert own | mistral <= OWN_CLASS_TYPES, sorted((own | mistral) - OWN_CLASS_TYPES)


@pytest.mark.parametrize("name", ["chatml", "qwen_trained"])
def test_no_transformers_import(folders, name):
    code = f"""
import sys
from preftune.model.tokenizer import Tokenizer
tok = Tokenizer.from_folder({str(folders[name])!r})
ids = tok(tok.apply_chat_template({CHATS[2]!r}, tools={TOOLS!r}, add_generation_prompt=True,
                                  tokenize=False), add_special_tokens=False).input_ids
tok.decode(ids, skip_special_tokens=True)
tok.pad_token = tok.eos_token
tok.save_pretrained({str(folders[name] / 'copy')!r})
assert "transformers" not in sys.modules, "transformers imported"
print(len(ids))
"""
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, run.stderr
    assert int(run.stdout) > 10
