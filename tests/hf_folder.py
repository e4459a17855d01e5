"""A Hugging Face folder's weights in tests, whichever way they were written: one
model.safetensors, or sharded files named by model.safetensors.index.json (final/ under FSDP2)."""
from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from preftune.model.hf_files import weight_files


def folder_state(folder: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's weight files by name (the index's files, else model.safetensors)."""
    files = weight_files(Path(folder))
    assert files, f"no weights in {folder}"
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def has_weights(folder: str | Path) -> bool:
    return bool(weight_files(Path(folder)))
