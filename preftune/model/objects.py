"""A loaded transformers model handed to `preftune.train(model=...)`, as the folder a run reads.

Everything that reads the base model (the policy, a reference, a resume, `preftune export`) reads a
folder named in the config, so the object is written once to OUTPUT_DIR/base_model with its
tokenizer; config.yaml names that folder. Passing the same model again (a resume) finds the same
weights there; a different model with checkpoints already trained from the first is refused.
"""
from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any

from preftune.errors import UserError
from preftune.model.load import load_tokenizer

FOLDER = "base_model"


def write_model_object(model: Any, processing_class: Any, output_dir: Path) -> str:
    """OUTPUT_DIR/base_model holding `model` and its tokenizer (`processing_class`, else the
    tokenizer of the folder the model was loaded from, as TRL falls back to it); returns the
    folder."""
    if hasattr(model, "peft_config"):
        raise UserError("a PEFT model: pass its base model, and the LoraConfig as peft_config",
                        where="model")
    if not (hasattr(model, "save_pretrained") and hasattr(model, "config")):
        raise UserError(f"a {type(model).__name__} is neither a "
                        "model folder nor a transformers model", where="model")
    # every rank would write the folder: each raises the same
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise UserError("a model object under torchrun: save it "
                        "(model.save_pretrained(folder)) and pass the folder",
                        where="model")
    tokenizer = processing_class
    if tokenizer is None:
        source = getattr(model, "name_or_path", "") or getattr(model.config, "_name_or_path", "")
        if not source or not os.path.isdir(source):
            raise UserError("the model object names no local folder to read its tokenizer from: "
                            "pass processing_class=tokenizer", where="model")
        tokenizer = load_tokenizer(source)
    folder, tmp = output_dir / FOLDER, output_dir / f".tmp-{FOLDER}"
    output_dir.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    tokenizer.save_pretrained(str(tmp))
    if folder.is_dir():
        if _weights(tmp) == _weights(folder):
            shutil.rmtree(tmp)
            return str(folder)
        if any((output_dir / "checkpoints").glob("step-*")):
            shutil.rmtree(tmp)
            raise UserError(f"{folder} holds another model than the one passed, "
                            "and the run's checkpoints were trained from it: "
                            "pass the same model, or another output_dir", where="model")
        shutil.rmtree(folder)
    os.replace(tmp, folder)
    return str(folder)


def _weights(folder: Path) -> dict[str, str]:
    """sha256 of each weight file: equal for the same weights written by the same library."""
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        h = hashlib.sha256()
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
        out[f.name] = h.hexdigest()
    return out
