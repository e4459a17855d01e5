"""Data-only files for trees of tensors and plain values: a JSON file for the structure, a
safetensors file for the tensors (`NAME.json`, `NAME.safetensors`).

Nothing read here can run code: no pickle anywhere (not even torch.load's restricted unpickler), so
a planted or rewritten file is at worst wrong data, which its reader refuses or trains on. Every
checkpoint file preftune writes goes through this module or is a Hugging Face file (JSON,
safetensors, the tokenizer's JSON). A value that is not a tensor, None, bool, int, float, str,
list, tuple or dict cannot be written (TypeError): such state has no place in a checkpoint.

The structure: a dict with str keys (none starting with "$") is a JSON object; other containers are
tagged: {"$tuple": [...]}, {"$dict": [[key, value], ...]}, a tensor {"$tensor": NAME} naming its
entry in the safetensors file (its path in the tree, joined by "/").
"""
from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

JSON, TENSORS = ".json", ".safetensors"
Leaf = Callable[[str, torch.Tensor], dict]  # (name, tensor) -> the JSON that stands for it


class TensorFileError(ValueError):
    """A state file that is not what preftune writes (damaged, foreign, or from another version)."""


def _part(key) -> str:
    return key if isinstance(key, str) else f"#{key!r}"


def encode(tree, leaf: Leaf, path: str = ""):
    """`tree` as JSON-able data; each tensor is replaced by what `leaf(name, tensor)` returns."""
    if isinstance(tree, torch.Tensor):
        return leaf(path, tree)
    if tree is None or isinstance(tree, (bool, int, str)):
        return tree
    if isinstance(tree, float):
        return tree if math.isfinite(tree) else {"$float": repr(tree)}
    if hasattr(tree, "item") and getattr(tree, "shape", None) == ():  # a numpy scalar
        return encode(tree.item(), leaf, path)
    sub = (lambda k: f"{path}/{_part(k)}") if path else _part
    if isinstance(tree, list):
        return [encode(v, leaf, sub(i)) for i, v in enumerate(tree)]
    if isinstance(tree, tuple):
        return {"$tuple": [encode(v, leaf, sub(i)) for i, v in enumerate(tree)]}
    if isinstance(tree, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in tree):
            return {k: encode(v, leaf, sub(k)) for k, v in tree.items()}
        return {"$dict": [[encode(k, leaf, sub(f"key{i}")), encode(v, leaf, sub(k))]
                          for i, (k, v) in enumerate(tree.items())]}
    raise TypeError(f"{path or 'state'}: a {type(tree).__name__} "
                    "cannot be written to a data-only state file")


def decode(data, tensor: Callable[[dict], torch.Tensor]):
    """The tree `encode` described; `tensor(marker)` gives the tensor for each tensor marker."""
    if isinstance(data, list):
        return [decode(v, tensor) for v in data]
    if not isinstance(data, dict):
        return data
    if "$tensor" in data or "$shard" in data:
        return tensor(data)
    if "$float" in data:
        return float(data["$float"])
    if "$tuple" in data:
        return tuple(decode(v, tensor) for v in data["$tuple"])
    if "$dict" in data:
        return {_hashable(decode(k, tensor)): decode(v, tensor) for k, v in data["$dict"]}
    return {k: decode(v, tensor) for k, v in data.items()}


def _hashable(key):
    if isinstance(key, (list, dict, torch.Tensor)):
        raise TensorFileError(f"a dict key that is a {type(key).__name__}")
    return key


def save(stem: Path, tree, *, extra: dict | None = None) -> None:
    """Write `stem`.json and `stem`.safetensors (tensors moved to the CPU, made contiguous)."""
    from safetensors.torch import save_file

    tensors: dict[str, torch.Tensor] = {}

    def leaf(name: str, t: torch.Tensor) -> dict:
        tensors[name] = t.detach().cpu().contiguous()
        return {"$tensor": name}

    doc = {"tree": encode(tree, leaf), **(extra or {})}
    write_pair(stem, doc, tensors, save_file)


def write_pair(stem: Path, doc: dict, tensors: dict, save_file) -> None:
    seen = set()
    for name, t in tensors.items():  # safetensors refuses tensors sharing storage: a copy for each
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            tensors[name] = t.clone()
        seen.add(ptr)
    save_file(tensors, str(stem.with_suffix(TENSORS)))
    stem.with_suffix(JSON).write_text(json.dumps(doc, allow_nan=False))


def read_doc(stem: Path) -> dict:
    try:
        doc = json.loads(stem.with_suffix(JSON).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise TensorFileError(f"{stem.name}{JSON} is not readable: {e}") from None
    if not isinstance(doc, dict) or "tree" not in doc:
        raise TensorFileError(f"{stem.name}{JSON} is not a preftune state file")
    return doc


def load(stem: Path) -> dict:
    """The tree that `save` wrote (tensors on the CPU)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    doc = read_doc(stem)
    try:
        tensors = load_file(str(stem.with_suffix(TENSORS)))
    except (OSError, SafetensorError) as e:
        raise TensorFileError(f"{stem.name}{TENSORS} is not readable: {e}") from None

    def tensor(marker: dict) -> torch.Tensor:
        name = marker.get("$tensor")
        if name not in tensors:
            raise TensorFileError(f"{stem.name}: tensor {name!r} is not in {stem.name}{TENSORS}")
        return tensors[name]

    return decode(doc["tree"], tensor)


def fill(dest: torch.Tensor, offset: list[int], pieces: list, what: str) -> None:
    """Fill `dest` (the region of a whole tensor at `offset`) from saved pieces, each (its offset in
    the whole tensor, an open safetensors file, its name there). Every element must be covered."""
    covered, seen = 0, set()
    for p_off, f, name in pieces:
        piece = f.get_slice(name)
        p_shape = list(piece.get_shape())
        if not isinstance(p_off, list) or len(p_off) != dest.dim() or len(p_shape) != dest.dim():
            raise TensorFileError(f"{what}: a piece of another rank's layout does not fit")
        if (tuple(p_off), tuple(p_shape)) in seen:  # a replicated piece: the same on every rank
            continue
        seen.add((tuple(p_off), tuple(p_shape)))
        lo = [max(a, b) for a, b in zip(offset, p_off)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(offset, dest.shape, p_off, p_shape)]
        if dest.dim() and any(h <= low for low, h in zip(lo, hi)):
            continue
        cut = tuple(slice(low - b, h - b) for low, h, b in zip(lo, hi, p_off))
        src = piece[cut] if dest.dim() else f.get_tensor(name)
        dest[tuple(slice(low - a, h - a) for low, h, a in zip(lo, hi, offset))].copy_(src)
        covered += math.prod(h - low for low, h in zip(lo, hi))
    if covered != dest.numel():
        raise TensorFileError(f"{what}: the shards hold {covered} of its {dest.numel()} values")
