"""The checkpointer's state dicts under any strategy and its sharded file format: each rank
writes its own pieces (`save_sharded`) and reads back the ones it owns at any world size
(`load_sharded`); whole state dicts for `final/` and a strategy change (`model_state(full=True)`,
`load_full_state`). torch.distributed.checkpoint's state-dict API does the gathering."""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from preftune import tensorfile


def _options(*, full: bool = False, trainable_only: bool = False, strict: bool = True):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=full, cpu_offload=full,
                            ignore_frozen_params=trainable_only,
                            strict=strict and not trainable_only)


def model_state(model, *, full: bool = False, trainable_only: bool = False) -> dict:
    """The model's state dict: this rank's shards (DTensors) or, with `full`, whole tensors on the
    CPU of rank 0 (an all-gather under FSDP: every rank must call it)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full=full, trainable_only=trainable_only))


def optimizer_state(model, optimizer, *, full: bool = False) -> dict:
    """Optimizer state keyed by parameter name (so it loads into any world size and strategy)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=_options(full=full))


def load_full_state(model, optimizer, weights: dict, optim: dict | None):
    """Whole-tensor weights (and name-keyed optimizer state) into a model of any strategy; returns
    the (missing, unexpected) keys of the weights."""
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    keys = set_model_state_dict(model, weights, options=_options(full=True, strict=False))
    if optim is not None:
        set_optimizer_state_dict(model, optimizer, optim, options=_options(full=True))
    return keys.missing_keys, keys.unexpected_keys


def save_sharded(model, optimizer, folder: Path, rank: int, *,
                 trainable_only: bool = False) -> None:
    """Each rank writes its pieces of the weights and optimizer state, data only (tensorfile.py):
    shards/rank-R.json (the structure; for each sharded tensor its global shape and this rank's
    offset in it) and shards/rank-R.safetensors (the pieces). Nothing is unpickled on reading them
    (torch.distributed.checkpoint's files are pickles, so they are not used)."""
    from safetensors.torch import save_file

    state = {"model": model_state(model, trainable_only=trainable_only),
             "optim": optimizer_state(model, optimizer)}
    pieces: dict[str, torch.Tensor] = {}

    def leaf(name: str, t: torch.Tensor) -> dict:
        local, offset = _local_piece(t)
        pieces[name] = local.detach().cpu().contiguous()
        return {"$shard": name, "shape": list(t.shape), "offset": offset}

    folder.mkdir(parents=True, exist_ok=True)
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    doc = {"tree": tensorfile.encode(state, leaf), "rank": rank, "world": world}
    tensorfile.write_pair(folder / f"rank-{rank}", doc, pieces, save_file)


def _local_piece(t: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """This rank's piece of a (possibly distributed) tensor and its offset in the whole tensor."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(t, DTensor):
        return t, [0] * t.dim()
    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return t.to_local(), list(offset)


def shard_files(folder: Path) -> list[str]:
    """The file names of a shards/ folder, from rank-0.json's world size (never a glob)."""
    world = tensorfile.read_doc(folder / "rank-0").get("world")
    if not isinstance(world, int) or world < 1:
        raise tensorfile.TensorFileError("shards/rank-0.json has no world size")
    return [f"rank-{r}{ext}" for r in range(world) for ext in (tensorfile.JSON, tensorfile.TENSORS)]


def load_sharded(model, optimizer, folder: Path, *, trainable_only: bool = False,
                 weights_only: bool = False) -> None:
    """Pieces written at any world size, cut to this rank's (or one plain process's) layout: each
    tensor of this rank's state dict is filled from the saved pieces that overlap it. A piece
    missing, or a shape that does not fit, raises TensorFileError."""
    from safetensors import SafetensorError
    from torch.distributed.checkpoint.state_dict import (
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    state = {"model": model_state(model, trainable_only=trainable_only)}
    if not weights_only:
        state["optim"] = optimizer_state(model, optimizer)
    targets: dict[str, torch.Tensor] = {}
    tensorfile.encode(state, lambda name, t: targets.setdefault(name, t) is None)
    try:
        saved = _read_pieces(folder, targets, list(state))
    except (SafetensorError, OSError, KeyError, TypeError) as e:
        raise tensorfile.TensorFileError(
            f"shards are not readable: {type(e).__name__}: {e}"
        ) from None
    set_model_state_dict(model, saved["model"], options=_options(trainable_only=trainable_only))
    if not weights_only:
        set_optimizer_state_dict(model, optimizer, saved["optim"])


def _read_pieces(folder: Path, targets: dict[str, torch.Tensor], parts: list[str]) -> dict:
    """The saved tree's `parts` (model, optim), each sharded tensor filled into its target."""
    from safetensors import safe_open

    names = shard_files(folder)
    docs = [tensorfile.read_doc(folder / n.removesuffix(tensorfile.JSON)) for n in names[::2]]
    found: dict[str, dict] = {}
    for r, doc in enumerate(docs):
        tensorfile.decode(doc["tree"], lambda m,
                          r=r: found.setdefault(m.get("$shard"), {}).setdefault(r, m))
    with contextlib.ExitStack() as stack:
        files = [
            stack.enter_context(safe_open(str(folder / n), framework="pt")) for n in names[1::2]
        ]

        def tensor(marker: dict) -> torch.Tensor:
            name = marker.get("$shard")
            target = targets.get(name)
            if target is None or marker.get("shape") != list(target.shape):
                want = None if target is None else list(target.shape)
                raise tensorfile.TensorFileError(f"shards: {name} does not fit the model "
                                                 f"({marker.get('shape')} vs {want})")
            local, offset = _local_piece(target)
            pieces = [(m.get("offset"), files[r], name) for r, m in found.get(name, {}).items()]
            tensorfile.fill(local, offset, pieces, f"shards: {name}")
            return target

        return {k: tensorfile.decode(docs[0]["tree"][k], tensor) for k in parts}
