"""The policy's tokenizer read from its folder with `tokenizers` and `jinja2` alone: importing
transformers (its modeling stack comes along with AutoTokenizer) is most of a restart's start-up.
`Tokenizer.from_folder` serves the folders for which transformers 5 builds its generic
TokenizersBackend or Qwen2Tokenizer (tokenizer_files.py rebuilds what either makes), so ids,
decoding and chat templates (chat_template.py) come out the same. Every other folder is left to
transformers (None)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from preftune.model.chat_template import read_templates, render, select
from preftune.model.tokenizer_files import (
    OWN_CLASS_TYPES, QWEN2_TYPES, build, special_strings)

__all__ = ["OWN_CLASS_TYPES", "QWEN2_TYPES", "Encoding", "Tokenizer"]


class Encoding(dict):
    """What `tok(text)` gives: `enc.input_ids` and `enc["input_ids"]`, as a BatchEncoding."""

    def __getattr__(self, key: str):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    def to(self, device) -> "Encoding":
        """Its tensors on `device` (with return_tensors="pt"), as BatchEncoding.to."""
        return Encoding({k: v.to(device) for k, v in self.items()})


class Tokenizer:
    """The subset of a transformers tokenizer that preftune (and a user's callback) calls."""

    def __init__(self, folder: Path):
        built = build(folder)
        kw = built.options
        self.name_or_path, self._folder = str(folder), folder
        self._cfg, self._stm = built.cfg, built.stm
        self._named, self._extra, self._changed = built.named, built.extra, set()
        self.padding_side = built.padding_side
        self.model_max_length = int(1e30) if kw.get("model_max_length") is None else kw[
            "model_max_length"]
        self.clean_up_tokenization_spaces = bool(kw.get("clean_up_tokenization_spaces", False))
        self._clean_bpe = bool(kw.get(
            "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output", False))
        self._backend, self._qwen2 = built.backend, built.kind == "qwen2"
        self._file_padding = built.backend.padding
        self._backend.no_padding()  # transformers pads only when a call asks for it
        self.chat_template = read_templates(folder, built.cfg)

    @classmethod
    def from_folder(cls, path) -> Tokenizer | None:
        """The tokenizer of a local folder, or None where transformers would build another class
        (or read a file this class does not): then AutoTokenizer must load it."""
        folder = Path(path)
        if not folder.is_dir():
            return None
        try:
            return cls(folder)
        except Exception:  # noqa: BLE001 - refused, or a folder we cannot read: transformers
            return None  # reads it (and says what is wrong)

    # special tokens: a string each (None when unset), their ids from the vocabulary
    def _get(self, name: str) -> str | None:
        value = self._named.get(name)
        return None if value is None else str(value)

    def convert_tokens_to_ids(self, tokens):
        """A token missing from the vocabulary is the unk token's id, as in transformers."""
        if isinstance(tokens, str):
            i = self._backend.token_to_id(tokens)
            unk = self._get("unk_token")
            return i if i is not None or unk is None else self._backend.token_to_id(unk)
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def _id(self, name: str) -> int | None:
        token = self._get(name)
        return None if token is None else self.convert_tokens_to_ids(token)

    bos_token = property(lambda self: self._get("bos_token"))
    eos_token = property(lambda self: self._get("eos_token"))
    unk_token = property(lambda self: self._get("unk_token"))
    bos_token_id = property(lambda self: self._id("bos_token"))
    eos_token_id = property(lambda self: self._id("eos_token"))
    unk_token_id = property(lambda self: self._id("unk_token"))
    pad_token_id = property(lambda self: self._id("pad_token"))

    @property
    def pad_token(self) -> str | None:
        return self._get("pad_token")

    @pad_token.setter
    def pad_token(self, value) -> None:
        self._named["pad_token"] = value
        self._changed.add("pad_token")

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {k: str(v) for k, v in self._named.items() if v is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        return special_strings(self._named, self._extra)

    backend_tokenizer = property(lambda self: self._backend)

    def __len__(self) -> int:
        return self._backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        return self._backend.get_vocab(with_added_tokens=True)

    def __call__(self, text, add_special_tokens: bool = True, padding=False,
                 padding_side: str | None = None, return_tensors: str | None = None,
                 return_offsets_mapping: bool = False) -> Encoding:
        """Batched when `text` is a list; padding (True/"longest") and "pt" tensors as
        transformers does them (the backend's own padding, to the longest row); with
        `return_offsets_mapping`, each token's (start, end) characters as `offset_mapping`."""
        batched = isinstance(text, (list, tuple))
        if padding not in (False, True, "longest", "do_not_pad") or return_tensors not in (
                None, "pt"):
            raise NotImplementedError(f"padding={padding!r}, return_tensors={return_tensors!r}")
        if padding not in (False, "do_not_pad"):
            self._backend.enable_padding(direction=padding_side or self.padding_side,
                                         pad_id=self.pad_token_id, pad_token=self.pad_token)
        try:
            rows = self._backend.encode_batch(list(text) if batched else [text],
                                              add_special_tokens=add_special_tokens)
        finally:
            self._backend.no_padding()
        out = Encoding(input_ids=[r.ids for r in rows],
                       attention_mask=[r.attention_mask for r in rows])
        if return_offsets_mapping:
            out["offset_mapping"] = [list(r.offsets) for r in rows]
        if return_tensors == "pt":
            import torch
            return Encoding({k: torch.tensor(v) for k, v in out.items()})
        return out if batched else Encoding({k: v[0] for k, v in out.items()})

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self(text, add_special_tokens=add_special_tokens).input_ids

    def decode(self, ids, skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool | None = None):
        """ids: an int, a list, a tensor or array (a batch of rows gives a list of strings)."""
        ids = ids.tolist() if hasattr(ids, "tolist") else ids
        ids = [ids] if isinstance(ids, int) else ids
        if ids and isinstance(ids[0], (list, tuple)):
            return [self.decode(r, skip_special_tokens, clean_up_tokenization_spaces) for r in ids]
        text = self._backend.decode(ids, skip_special_tokens=skip_special_tokens)
        clean = self.clean_up_tokenization_spaces if clean_up_tokenization_spaces is None \
            else clean_up_tokenization_spaces
        # transformers 5 skips the clean-up for BPE models: it would eat real spaces
        if clean and (type(self._backend.model).__name__ != "BPE" or self._clean_bpe):
            for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"),
                         (" n't", "n't"), (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"),
                         (" 're", "'re")):
                text = text.replace(a, b)
        return text

    def batch_decode(self, sequences, skip_special_tokens: bool = False,
                     clean_up_tokenization_spaces: bool | None = None) -> list[str]:
        out = self.decode(sequences, skip_special_tokens, clean_up_tokenization_spaces)
        return [out] if isinstance(out, str) else out

    def apply_chat_template(self, conversation, tools=None, documents=None, chat_template=None,
                            add_generation_prompt: bool = False,
                            continue_final_message: bool | str = False, tokenize: bool = True,
                            padding=False, return_tensors=None, return_dict: bool = True,
                            **kwargs):
        """transformers' apply_chat_template: the text (tokenize=False), else the Encoding of it
        without special tokens added (its input_ids alone with return_dict=False)."""
        template = select(self.chat_template, chat_template, tools)
        text = render(template, conversation, tools=tools, documents=documents,
                       add_generation_prompt=add_generation_prompt,
                       continue_final_message=continue_final_message,
                       **{**self.special_tokens_map, **kwargs})
        if not tokenize:
            return text
        out = self(text, add_special_tokens=False, padding=padding, return_tensors=return_tensors)
        return out if return_dict else out["input_ids"]

    def save_pretrained(self, out) -> tuple[str, ...]:
        """The folder's tokenizer files again, tokenizer_config.json (and special_tokens_map.json)
        carrying the special tokens set since: AutoTokenizer (vLLM too) loads this tokenizer.
        A Qwen2Tokenizer is saved as transformers saves it: its rebuilt pipeline as tokenizer.json
        (so a reader of that file alone tokenizes alike), its class named in the config."""
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        written = [self._save_backend(out / "tokenizer.json")] if self._qwen2 else []
        for name in ("chat_template.jinja", "additional_chat_templates") if self._qwen2 else (
                "tokenizer.json", "chat_template.jinja", "additional_chat_templates"):
            src, dst = self._folder / name, out / name
            if src.exists() and src.resolve() != dst.resolve():
                if src.is_dir():
                    shutil.copytree(src, dst, dirs_exist_ok=True)
                else:
                    shutil.copyfile(src, dst)
            written += [str(dst)] if src.exists() else []
        changed = {k: self._get(k) for k in self._changed}
        files = {"tokenizer_config.json": self._cfg | changed | (
            {"tokenizer_class": "Qwen2Tokenizer"} if self._qwen2 else {})}
        if self._stm is not None:
            files["special_tokens_map.json"] = self._stm | {
                k: v for k, v in changed.items() if k in self._stm}
        for name, doc in files.items():
            (out / name).write_text(json.dumps(doc, indent=2, ensure_ascii=False) + "\n",
                                    encoding="utf-8")
            written.append(str(out / name))
        return tuple(written)

    def _save_backend(self, path: Path) -> str:
        """The backend as transformers holds it: tokenizer.json's padding on."""
        if self._file_padding is not None:
            self._backend.enable_padding(**self._file_padding)
        try:
            path.write_text(self._backend.to_str(pretty=True), encoding="utf-8")
        finally:
            self._backend.no_padding()
        return str(path)
