"""What transformers 5's AutoTokenizer builds from a local tokenizer folder, rebuilt with the
`tokenizers` API alone: which class it picks (the generic TokenizersBackend, or Qwen2Tokenizer,
which rebuilds its pipeline from tokenizer.json's vocab and merges), the backend it makes, and the
special tokens it sets and adds. A folder it would read some other way is `Refused`, so the
caller leaves it to transformers."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE
from tokenizers.processors import TemplateProcessing

NAMED = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
GENERIC = ("PreTrainedTokenizerFast", "TokenizersBackend")
QWEN2_CLASSES = ("Qwen2Tokenizer", "Qwen2TokenizerFast")
# config.json model types for which AutoTokenizer picks its own class over a generic
# tokenizer_class (MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS with a class of their own, and the
# MistralCommonBackend types); tests/model/test_tokenizer.py checks this against transformers
OWN_CLASS_TYPES = frozenset({
    "qwen2", "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "hyperclovax_vision_v2",
    "mistral", "mistral3", "ministral", "ministral3", "mixtral", "pixtral", "voxtral",
    "voxtral_realtime"})
# the language models' types that transformers maps to Qwen2Tokenizer (its multimodal ones too,
# left to it); of these only qwen2 overrides a generic tokenizer_class (it is in OWN_CLASS_TYPES)
QWEN2_TYPES = frozenset({"qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "qwen3_next"})
QWEN2_DEFAULT = "<|endoftext|>"  # Qwen2Tokenizer's unk, eos and pad when the config names none
QWEN2_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+"""
               r"""[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""")
# tokenizer_config.json keys whose effect is reproduced here, or that have none (add_bos/eos_token
# are dropped when there is a tokenizer.json; the rest are only stored)
KNOWN_KEYS = frozenset({
    *NAMED, "tokenizer_class", "chat_template", "added_tokens_decoder", "extra_special_tokens",
    "additional_special_tokens", "clean_up_tokenization_spaces", "split_special_tokens",
    "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", "model_max_length",
    "padding_side", "truncation_side", "add_bos_token", "add_eos_token", "add_prefix_space",
    "errors", "legacy", "processor_class", "spaces_between_special_tokens", "backend", "is_local",
    "use_default_system_prompt", "local_files_only", "max_length", "pad_to_multiple_of",
    "pad_token_type_id", "stride", "truncation_strategy"})


class Refused(Exception):
    """transformers would read this folder with another class or file than those mirrored here."""


@dataclass
class Built:
    backend: Backend  # as transformers leaves it, tokenizer.json's padding still on
    named: dict  # each of NAMED: a str, an AddedToken, or None
    extra: list  # extra_special_tokens
    options: dict  # tokenizer_config.json as the class's __init__ receives it
    padding_side: str
    kind: str  # "generic" or "qwen2"
    cfg: dict  # tokenizer_config.json as read
    stm: dict | None  # special_tokens_map.json where transformers reads it


def read_json(path: Path) -> dict | None:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else None


def special_strings(named: dict, extra: list) -> list[str]:
    """all_special_tokens: the named ones, then the extra ones, each once."""
    return list(dict.fromkeys([*(str(v) for v in named.values() if v is not None),
                               *map(str, extra)]))


def _token(value):
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict) and value.get("__type") == "AddedToken":
        return AddedToken(**{k: v for k, v in value.items() if k != "__type"})
    if value is None or isinstance(value, (str, AddedToken)):
        return value
    raise Refused(f"unsupported special token {value!r}")


def _special(value):
    """A special_tokens_map.json entry: a dict is an AddedToken marked special."""
    if isinstance(value, dict):
        return AddedToken(**{k: v for k, v in value.items() if k != "special"}, special=True)
    return value


def choose(folder: Path, cfg: dict, stm: dict | None) -> str:
    """"generic" or "qwen2": the class AutoTokenizer builds for this folder; Refused otherwise."""
    if not (folder / "tokenizer.json").is_file():
        raise Refused("no tokenizer.json")
    if (folder / "added_tokens.json").is_file():
        raise Refused("added_tokens.json")
    if unknown := sorted(set(cfg) - KNOWN_KEYS):
        raise Refused(f"tokenizer_config keys {unknown}")
    if isinstance(cfg.get("extra_special_tokens"), dict) or isinstance(cfg.get(
            "additional_special_tokens"), dict):
        raise Refused("named extra special tokens")
    if stm and set(stm) - set(NAMED) - {"extra_special_tokens"}:
        raise Refused(f"special_tokens_map.json keys {sorted(stm)}")
    model, hub = read_json(folder / "config.json"), cfg.get("tokenizer_class")
    kind = model and model.get("model_type")
    if model and model.get("model_name") not in (None, kind) and model["model_name"] in \
            OWN_CLASS_TYPES:
        raise Refused(f"model_name {model['model_name']}: its own tokenizer class")
    if hub is None and model is None:
        return "generic"
    if hub is None and kind in QWEN2_TYPES and not model.get("tokenizer_class"):
        return "qwen2"  # the model type's class
    if hub in GENERIC and kind in OWN_CLASS_TYPES:  # the model type's class wins
        if kind in QWEN2_TYPES:
            return "qwen2"
        raise Refused(f"model_type {kind}: its own tokenizer class")
    if hub in GENERIC:
        return "generic"
    if hub in QWEN2_CLASSES and (model is None or kind in QWEN2_TYPES):
        return "qwen2"
    raise Refused(f"tokenizer_class {hub}, model_type {kind}")


def _options(folder: Path, cfg: dict, stm: dict | None, text: str):
    """The config as transformers passes it on (add_bos/eos_token dropped, the legacy
    special_tokens_map.json merged in) and the added tokens by id: the config's
    added_tokens_decoder, else tokenizer.json's added tokens."""
    kw = {k: v for k, v in cfg.items() if k not in ("add_bos_token", "add_eos_token")}
    if "additional_special_tokens" in kw and not kw.get("extra_special_tokens"):
        kw["extra_special_tokens"] = kw.pop("additional_special_tokens")
    if "added_tokens_decoder" in kw:
        return kw, {int(i): AddedToken(**t) for i, t in kw["added_tokens_decoder"].items()}
    for key, value in (stm or {}).items():
        if key == "extra_special_tokens":
            have = list(kw.get("extra_special_tokens") or [])
            value = have + [t for t in map(_special, value) if t not in have]
        kw[key] = value if key == "extra_special_tokens" else _special(value)
    return kw, {t.pop("id"): AddedToken(**t) for t in json.loads(text)["added_tokens"]}


def _qwen2_backend(text: str, add_prefix_space) -> Backend:
    """Qwen2Tokenizer's pipeline over tokenizer.json's BPE vocab and merges: NFC, its Split
    regex then byte-level pre-tokenization, byte-level decoding; the file's post-processor and
    padding kept, its added tokens left to the special-token steps."""
    doc = json.loads(text)
    model = doc["model"]
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise Refused(f"a {model.get('type')} model in tokenizer.json")
    if add_prefix_space not in (None, True, False):
        raise Refused(f"add_prefix_space {add_prefix_space!r}")
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in model.get("merges") or []]
    backend = Backend(BPE(vocab=model["vocab"], merges=merges, dropout=None, unk_token=None,
                          continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False,
                          byte_fallback=False))
    backend.decoder = decoders.ByteLevel()
    backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=bool(add_prefix_space), use_regex=False)])
    empty = doc | {"added_tokens": [], "model": model | {"vocab": {}, "merges": []}}
    file = Backend.from_str(json.dumps(empty))  # the file's own parts, without its vocabulary
    if file.truncation is not None:
        raise Refused("truncation in tokenizer.json")
    if file.post_processor is not None:
        backend.post_processor = file.post_processor
    if file.padding is not None:
        backend.enable_padding(**file.padding)
    return backend


def build(folder: Path) -> Built:
    """The backend and special tokens transformers' class builds from this folder."""
    cfg = read_json(folder / "tokenizer_config.json") or {}
    stm = None if "added_tokens_decoder" in cfg else read_json(folder / "special_tokens_map.json")
    kind = choose(folder, cfg, stm)
    text = (folder / "tokenizer.json").read_text(encoding="utf-8")
    kw, added = _options(folder, cfg, stm, text)
    if kind == "qwen2":
        backend = _qwen2_backend(text, kw.get("add_prefix_space"))
    else:
        backend = Backend.from_str(text)
        if backend.truncation is not None:
            raise Refused("truncation in tokenizer.json")
    by_text = {str(t): t for t in added.values()}
    named = {k: _token(kw[k]) for k in NAMED if k in kw}
    named = {k: by_text.get(str(v), v) if v is not None else v for k, v in named.items()}
    if kind == "qwen2":  # the class's defaults, as plain strings
        named = {"unk_token": QWEN2_DEFAULT, "eos_token": QWEN2_DEFAULT,
                 "pad_token": QWEN2_DEFAULT} | named
    elif backend.padding is not None and "pad_token" not in kw:
        named["pad_token"] = backend.padding["pad_token"]
    named = {k: named.get(k) for k in NAMED}
    extra = [_token(t) for t in kw.get("extra_special_tokens") or []]
    side = kw.get("padding_side") or (
        backend.padding["direction"].lower() if backend.padding else "right")
    backend.encode_special_tokens = bool(kw.get("split_special_tokens", False))
    _add_special(backend, added, named, extra)
    if backend.post_processor is None:
        backend.post_processor = TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
    if kind == "qwen2":  # Qwen2Tokenizer.__init__'s last step: every special token once more
        backend.add_tokens([AddedToken(t, special=True) for t in special_strings(named, extra)])
    return Built(backend, named, extra, kw, side, kind, cfg, stm)


def _add_special(backend: Backend, added: dict[int, AddedToken], named: dict,
                 extra: list) -> None:
    """TokenizersBackend.__init__'s one add_tokens call: every added token of the files again
    (its check for those already present never matches), then the special tokens not among
    them; a named one is marked special. Same calls, same Rust state."""
    todo = [t for _, t in sorted(added.items(), key=lambda x: x[0])]
    present = list(backend.get_added_tokens_decoder().values())
    have = [t.content for t in present] + [str(t) for t in todo]
    for value in [*named.values(), *extra]:
        if value is not None and str(value) not in have and value not in todo:
            todo.append(value)
    names = [str(t) for t in named.values() if t]
    out = []
    for t in todo:
        if isinstance(t, str):
            t = AddedToken(t, special=True)
        elif not t.special and str(t) in names:
            t.special = True
        out.append(t)
    if out:
        backend.add_tokens(out)
