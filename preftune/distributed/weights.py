"""A model's weights between Hugging Face files and FSDP2 shards, one tensor at a time, so no
process holds the whole model unless it must (docs/distributed.md).

Loading (`sliceable`, `read_shards`): each rank reads only its own rows of each parameter from the
folder's safetensors files, in the dtype it holds. FSDP2 shards dim 0 (`Shard(0)`) as torch.chunk
cuts it: ceil(n / world) rows per rank, the last ranks' shorter or empty (`rows`).
Writing (`write_weights`): the tensors are cut into files of contiguous groups, file i written by
rank i % world; every rank all-gathers each tensor in the same order (a collective), casts it to
the saved dtype and, when its own file holds it, appends its bytes (model/hf_files.FileWriter),
then drops it; a LoRA-adapted projection is written merged, from its gathered base weight and
adapter. Peak host memory per rank: about one whole tensor."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from preftune.model import hf_files
from preftune.model.core import CausalLM
from preftune.model.load import base_module, device_of
from preftune.model.ops import merged


def rows(n: int, world: int, rank: int) -> tuple[int, int]:
    """The rows [start, stop) of a dim of n rows that `rank` holds under Shard(0): torch.chunk's
    cut (ceil(n / world) each, so the last ranks may hold fewer, or none)."""
    size = -(-n // world)
    start = min(rank * size, n)
    return start, min(start + size, n)


def _local(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """This rank's piece of a parameter (a DTensor sharded on dim 0, or a whole tensor) and the rows
    of the whole it holds."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(t, DTensor):
        return t.data, 0, t.shape[0] if t.dim() else 0
    if t.device_mesh.ndim != 1 or t.placements[0] != Shard(0):
        raise ValueError(f"a {t.placements} parameter: only FSDP2's Shard(0) is read in slices")
    local = t.to_local()
    start, stop = rows(t.shape[0], t.device_mesh.size(), t.device_mesh.get_local_rank())
    if local.shape[0] != stop - start:  # the rule above must be FSDP2's own
        raise ValueError(f"shard of {local.shape[0]} rows where torch.chunk gives {stop - start}")
    return local, start, stop


def sliceable(model, tensors: dict[str, hf_files.Stored]) -> str | None:
    """None when each rank can read its slices of every parameter (`hf_files.stored_as_is`),
    else why not."""
    if not isinstance(model, CausalLM):
        return "the Hugging Face module may rename the stored tensors"
    return hf_files.stored_as_is(model, tensors)


@torch.no_grad()
def read_shards(model, tensors: dict[str, hf_files.Stored]) -> None:
    """Every parameter's local shard filled from the files: only this rank's rows are read, one
    tensor at a time, cast to the parameter's dtype (`sliceable` must have said None)."""
    for name, p in hf_files.params_to_read(model, tensors):
        local, start, stop = _local(p)
        if local.numel():  # (stop-start, ...)
            local.copy_(type(model).read_stored(tensors, name, start, stop, local.dtype))


@dataclass
class Saved:
    """One tensor of a Hugging Face folder of the model: its name, shape, the dtype held, and the
    tensor whole (under FSDP2 a collective every rank runs in the same order)."""
    name: str
    shape: tuple
    dtype: torch.dtype
    whole: Callable[[], torch.Tensor]


def saved_tensors(model) -> list[Saved]:
    """What a Hugging Face folder of `model` (an own module, LoRA-wrapped or not) holds, in
    state-dict order: every parameter and persistent buffer, a tied head left out (its embedding
    is it), and each LoRA-adapted projection under its own name with the adapter merged in
    (`ops.merged`, as PEFT's merge_and_unload); the adapters themselves are not saved."""
    own = base_module(model)
    adapted = {name: m for name, m in own.named_modules() if hasattr(m, "base_layer")}
    out = []
    for name, t in own.state_dict(keep_vars=True).items():
        prefix, _, rest = name.rpartition(".base_layer.")
        if prefix in adapted:
            name = f"{prefix}.{rest}"
            if rest == "weight":
                whole = functools.partial(_merged_weight, adapted[prefix])
                out.append(Saved(name, tuple(t.shape), t.dtype, whole))
                continue
        elif name.partition(".lora_")[0] in adapted:  # the adapter: merged above
            continue
        out.append(Saved(name, tuple(t.shape), t.dtype, functools.partial(full_tensor, t)))
    if getattr(own, "tied", False):
        out = [s for s in out if s.name != "lm_head.weight"]
    return out


def _merged_weight(linear) -> torch.Tensor:
    return merged(linear, full_tensor)[0]


def write_weights(model, folder: Path, dtype: torch.dtype, *, rank: int = 0,
                  world: int = 1) -> None:
    """The weights of `model` (an own `CausalLM`, sharded or whole, LoRA merged: `saved_tensors`)
    as safetensors files in `folder` in `dtype` (floating tensors; others as they are), with
    model.safetensors.index.json when there is more than one file. A sharded model: every rank
    calls this (each tensor is all-gathered in turn), each writes its own files; `rank` 0 writes
    the index."""
    tensors = saved_tensors(model)
    specs = [(t.name, t.shape, dtype if t.dtype.is_floating_point else t.dtype) for t in tensors]
    groups = hf_files.split(specs, world)
    names = hf_files.file_names(len(groups))
    file_of = {i: g for g, members in enumerate(groups) for i in members}
    writers = {g: hf_files.FileWriter(folder / names[g], [specs[i] for i in members])
               for g, members in enumerate(groups) if g % world == rank}
    failed: OSError | None = None
    try:
        for i, t in enumerate(tensors):  # the same order on every rank: collectives
            whole = t.whole()
            writer = writers.get(file_of[i])
            if writer is not None and failed is None:
                try:
                    writer.write(t.name, whole.to(specs[i][2]).cpu())  # (shape) in the saved dtype
                except OSError as e:  # a full disk: keep gathering, or the other ranks would hang
                    failed = e
            del whole
    finally:
        for w in writers.values():
            w.file.close()
    if failed is not None:
        raise failed
    for w in writers.values():
        w.close()
    if rank == 0 and len(groups) > 1:
        where = {name: names[file_of[i]] for i, (name, *_) in enumerate(specs)}
        hf_files.write_index(folder, where, sum(hf_files.nbytes(s, d) for _, s, d in specs))


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A parameter whole: an FSDP2 shard (a DTensor) all-gathered, a collective every rank runs in
    the same order; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t.detach()
    if t.device.type != t.device_mesh.device_type:  # an offloaded shard: nccl gathers on the device
        t = t.to(device_of(t))
    return t.full_tensor().detach()
