"""`preftune export CHECKPOINT -o DIR`: a consolidated Hugging Face model from any step checkpoint.

Full-layout checkpoints (one process, ddp) and sharded ones (FSDP2, any world size) alike: the
base model named in the checkpoint's preftune.yaml is loaded on the CPU, the checkpoint's weights
(or LoRA adapter) are loaded into it, LoRA is merged, and the model is written in model.dtype with
a manifest, atomically (built beside DIR, then renamed); preftune's own module through final/'s
writer (sharded safetensors files with their index past 5 GB, one tensor cast at a time).
Runs in one process, no GPU needed.
The checkpoint is data: nothing in it is unpickled or imported, and `trust_remote_code` comes from
the command line (`--trust-remote-code`), never from the checkpoint's preftune.yaml.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from preftune.errors import UserError
from preftune.run import checkpoint_folders as ckpt


def add_parser(sub) -> None:
    p = sub.add_parser("export",
                       help="write a Hugging Face model from a step checkpoint (sharded or not)")
    p.add_argument("checkpoint", help="a checkpoints/step-N folder")
    p.add_argument("-o", "--output", required=True,
                   help="the model folder to write (must not exist or be empty)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the base model's own modeling code "
                   "(auto_map); never taken from the checkpoint")
    p.set_defaults(handler=run)


def run(args) -> int:
    out = export(Path(args.checkpoint), Path(args.output), trust_remote_code=args.trust_remote_code)
    print(f"exported {args.checkpoint} -> {out}")
    return 0


def export(folder: Path, out: Path, *, trust_remote_code: bool = False) -> Path:
    from preftune.config import load_config
    from preftune.distributed.weights import write_weights
    from preftune.model.core import CausalLM
    from preftune.model.load import (DTYPES, base_module, load_model, load_tokenizer,
                                     save_folder_files, save_pretrained)
    from preftune.run import shards
    from preftune.run.checkpointer import SHARDS, is_lora, load_weights
    from preftune.run.resume import CONFIG_FILE, STEP_FILES
    from preftune.tensorfile import TensorFileError

    problem = ckpt.verify(folder, STEP_FILES)
    if problem:
        raise UserError(f"not a complete checkpoint: {problem}", where=str(folder))
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError("output folder exists and is not empty", where=str(out))
    cfg = load_config(folder / CONFIG_FILE)
    cfg.model.trust_remote_code = trust_remote_code
    model = load_model(cfg.model, cfg.model.name_or_path)
    try:
        if (folder / SHARDS).is_dir():
            shards.load_sharded(model, None, folder / SHARDS,
                              trainable_only=is_lora(model), weights_only=True)
        else:
            load_weights(model, folder)
    except TensorFileError as e:
        raise UserError(f"not a readable checkpoint: {e}", where=str(folder)) from None
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    tokenizer = load_tokenizer(str(folder), trust_remote_code)
    if isinstance(base_module(model), CausalLM):  # final/'s writer (LoRA merged), one process
        tmp.mkdir()
        write_weights(model, tmp, DTYPES[cfg.model.dtype])
        save_folder_files(model, tokenizer, tmp, dtype=cfg.model.dtype)
    else:  # the Hugging Face module (LoRA merged): its own save_pretrained
        save_pretrained(model, tokenizer, tmp, dtype=cfg.model.dtype)
    ckpt.write_manifest(tmp,
                        ckpt.read_manifest((folder / ckpt.MANIFEST).read_text()).get("step", 0))
    ckpt.fsync_tree(tmp)
    if out.exists():
        out.rmdir()  # empty (checked above)
    ckpt.publish(tmp, out)
    return out
