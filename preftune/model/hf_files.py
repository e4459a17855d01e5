"""A Hugging Face folder's safetensors files, one tensor at a time: which tensors it holds, their
shapes and dtypes and which file holds each (`stored`), rows of one tensor read in a wanted dtype
(`read_rows`, or a whole model filled with `read_into`), and the sharded layout written back
(`split`, `FileWriter`, `write_index`).

Nothing here reads a whole file into memory: headers are parsed, slices are read through the
memory map, and a file is written as its header first (every tensor's shape and dtype are known
before any is gathered), then each tensor's bytes appended as it arrives. So a process that loads
or writes a model holds about one tensor at a time (docs/distributed.md)."""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
MAX_FILE_BYTES = 5 * 10**9  # per written file, as Hugging Face shards a model
# safetensors' dtype names
_CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16",
          torch.float64: "F64", torch.int64: "I64", torch.int32: "I32", torch.int16: "I16",
          torch.int8: "I8", torch.uint8: "U8", torch.bool: "BOOL"}


@dataclass(frozen=True)
class Stored:
    """One tensor of a folder: the file that holds it, its shape and safetensors dtype."""
    file: Path
    shape: tuple[int, ...]
    dtype: str


def weight_files(folder: Path) -> list[Path]:
    """The weight files of a Hugging Face folder: those model.safetensors.index.json names when it
    is there, else model.safetensors. Never a glob: a file planted beside them is never read."""
    index = folder / INDEX
    if not index.is_file():
        return [folder / SINGLE] if (folder / SINGLE).is_file() else []
    try:
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"{index.name} is not a weight index ({type(e).__name__})") from None
    if not all(isinstance(n, str) and "/" not in n and n.endswith(".safetensors") for n in names):
        raise ValueError(f"{index.name} names files outside the folder or not safetensors")
    return [folder / n for n in names]


def stored(folder: str | Path) -> dict[str, Stored]:
    """Every tensor of the folder's weight files by name, from the files' headers alone."""
    from safetensors import safe_open

    out: dict[str, Stored] = {}
    for f in weight_files(Path(folder)):
        with safe_open(str(f), framework="pt") as handle:
            for name in handle.keys():
                part = handle.get_slice(name)
                out[name] = Stored(f, tuple(part.get_shape()), part.get_dtype())
    return out


def read_rows(tensor: Stored, name: str, start: int, stop: int,
              dtype: torch.dtype) -> torch.Tensor:
    """Rows start..stop-1 of tensor `name` (dim 0; a 0-dim tensor whole) in `dtype`: only those
    bytes are read. The file is opened (mapped) for this tensor alone: a mapping kept open would
    keep every page read so far in the process's memory."""
    from safetensors import safe_open

    with safe_open(str(tensor.file), framework="pt") as handle:
        part = handle.get_slice(name)
        t = part[start:stop] if len(tensor.shape) else part[:]  # (stop-start, ...)
    return t.to(dtype)


def params_as_stored(model, tensors: dict) -> list[tuple[str | None, torch.Tensor]]:
    """Each parameter of `model` once, with the name it is stored under (a tied head and its
    embedding are one parameter under two names, either of which the files may hold), or None
    when none is."""
    names: dict[int, list[str]] = {}
    params: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
        params[id(p)] = p
    return [(next((n for n in names[k] if n in tensors), None), p) for k, p in params.items()]


def stored_as_is(model, tensors: dict[str, Stored]) -> str | None:
    """None when every parameter of `model` can be read one tensor at a time: stored under its own
    name and shape, or made of stored tensors as the family says (`stored_layout`, e.g. Qwen3-MoE's
    per-expert modules stacked into 3-D experts), and nothing else stored; else why not."""
    if not tensors:
        return "no safetensors weights (model.safetensors or its index)"
    shapes = {name: t.shape for name, t in tensors.items()}
    consumed: set[str] = set()
    for name, (shape, parts) in type(model).stored_layout(tensors).items():
        shapes[name] = shape
        consumed.update(parts)
    names = dict(model.named_parameters(remove_duplicate=False))
    extra = sorted(set(tensors) - consumed - set(names))
    if extra:
        return f"the files hold {extra[0]}, which is not a parameter as stored"
    for name, p in params_as_stored(model, shapes):
        if name is None:
            return f"a parameter of shape {tuple(p.shape)} is not stored"
        if shapes[name] != tuple(p.shape):
            return f"{name} is stored as {shapes[name]}, the model has {tuple(p.shape)}"
    return None


def params_to_read(model, tensors: dict[str, Stored]) -> list[tuple[str, torch.Tensor]]:
    """Each parameter once with the name `read_stored` reads it by: stored as is, or made of
    stored tensors as the family says (`stored_as_is` must have said None)."""
    return params_as_stored(model, {**tensors, **type(model).stored_layout(tensors)})


@torch.no_grad()
def read_into(model, tensors: dict[str, Stored]) -> None:
    """Every parameter of a whole (unsharded) `model` filled from the files, one tensor at a
    time, cast to the parameter's dtype (`stored_as_is` must have said None)."""
    for name, p in params_to_read(model, tensors):
        n = p.shape[0] if p.dim() else 0
        p.copy_(type(model).read_stored(tensors, name, 0, n, p.dtype))


def nbytes(shape, dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


def split(tensors: list[tuple[str, tuple, torch.dtype]], files: int,
          max_bytes: int = MAX_FILE_BYTES) -> list[list[int]]:
    """Tensors (name, shape, dtype), in order, cut into contiguous groups of about equal bytes: at
    least `files` groups (the writing ranks) and none over `max_bytes` where a tensor allows;
    never an empty group. Returns each group's tensor indices."""
    sizes = [nbytes(shape, dtype) for _, shape, dtype in tensors]
    total = max(sum(sizes), 1)
    n = max(1, min(len(tensors), max(files, math.ceil(total / max_bytes))))
    groups: list[list[int]] = []
    seen, last = 0, -1
    for i, size in enumerate(sizes):
        # the group a tensor's middle byte falls in: groups grow in order, about total / n each
        g = min(n - 1, int(n * (seen + size / 2) / total))
        if g > last:
            groups.append([])
            last = g
        groups[-1].append(i)
        seen += size
    return groups


def file_names(n: int) -> list[str]:
    """Hugging Face's names: model.safetensors alone, else model-0000i-of-0000n.safetensors."""
    return [SINGLE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


class FileWriter:
    """One safetensors file written as its tensors arrive, in the order of `tensors`: the header
    (offsets from the known shapes and dtypes) first, each tensor's bytes appended by `write`."""

    def __init__(self, path: Path, tensors: list[tuple[str, tuple, torch.dtype]]):
        header: dict = {"__metadata__": {"format": "pt"}}
        self.order, offset = [name for name, _, _ in tensors], 0
        self.specs = {}
        for name, shape, dtype in tensors:
            size = nbytes(shape, dtype)
            header[name] = {"dtype": _CODES[dtype], "shape": list(shape),
                            "data_offsets": [offset, offset + size]}
            self.specs[name] = (tuple(shape), dtype)
            offset += size
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors pads it
        self.file = open(path, "wb")  # noqa: SIM115 - closed by `close`, after the last tensor
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.next = 0

    def write(self, name: str, t: torch.Tensor) -> None:
        """The next tensor in the header's order (a CPU tensor of the declared shape and dtype)."""
        if name != self.order[self.next] or (tuple(t.shape), t.dtype) != self.specs[name]:
            raise ValueError(f"{name}: not the next tensor of {self.file.name} as declared")
        flat = t.detach().contiguous().reshape(-1).view(torch.uint8)  # (bytes,) the same memory
        self.file.write(flat.numpy().data)
        self.next += 1

    def close(self) -> None:
        self.file.close()
        if self.next != len(self.order):
            raise ValueError(f"{self.file.name}: {len(self.order) - self.next} tensors not written")


def write_index(folder: Path, weight_map: dict[str, str], total_size: int) -> None:
    """model.safetensors.index.json as Hugging Face writes it (only for more than one file)."""
    doc = {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX).write_text(json.dumps(doc, indent=2) + "\n")
