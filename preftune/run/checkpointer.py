"""The one owner of a run's checkpoints: "save at step N", "restore from this folder", "write
final/".

The loop calls `Checkpointer.save(step)` / `.restore(folder)` / `.write_final(step)`; how the state
is laid out is this module's business. Two layouts, one folder lifecycle (checkpoint.py: scratch
folder, manifest last, fsync, atomic rename, retention, remote mirror):

full     (one process, or ddp where every rank holds the same weights; rank 0 writes)
         full fine-tuning: the model in Hugging Face format (loadable by from_pretrained);
         LoRA: only `adapter/` (peft format) - no merged copy per save.
sharded  (fsdp) `shards/rank-R.json` + `.safetensors`: each rank writes its pieces of the weights
         (LoRA: the adapter only) and of the optimizer state (`shards.save_sharded`).
Both: `trainer_state.json` + `.safetensors` (rank 0: step, optimizer state keyed by parameter name
in the full layout, the task's state, RNGs), `rank-R.*` for each other rank (its task state and
RNGs), the tokenizer,
the model's config.json, preftune.yaml, metrics.jsonl and MANIFEST.json - written last, by rank 0,
from the file hashes every rank computed for its share of the files, after a barrier.
`final/` is always one consolidated Hugging Face model (LoRA merged once, at the end): sharded
safetensors files plus model.safetensors.index.json when more than one (`write_final`).
Every file is data (JSON, safetensors; preftune/tensorfile.py): a restore or an export reads only
the files the layout names (weights through the Hugging Face index, never a glob) and unpickles
nothing.
"""
from __future__ import annotations

import contextlib
import logging
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from preftune.errors import CheckpointDamaged, Unavailable, UserError, one_line
from preftune.tensorfile import TensorFileError
from preftune.model.core import CausalLM
from preftune.model.hf_files import weight_files
from preftune.model.load import (DTYPES, base_module, load_model, save_folder_files,
                                 save_generation_config, save_pretrained)
from preftune.run import checkpoint_folders as ckpt
from preftune.run.resume import CONFIG_FILE, checkpoint_config
from preftune.distributed.group import Parallel
from preftune.distributed.weights import write_weights
from preftune.run import shards

log = logging.getLogger("preftune")
UPLOAD_MARGIN_S = 5.0  # of the grace period, kept for exiting after the last upload wait
METRICS = "metrics.jsonl"
SHARDS = "shards"
ADAPTER = "adapter"


def rng_state() -> dict:
    """Every global RNG as plain tensors/ints/floats (data only: tensorfile.py writes and reads
    them)."""
    _, py_state, py_gauss = random.getstate()
    _, mt, pos, has_gauss, gauss = np.random.get_state()
    state = {"python": list(py_state), "python_gauss": py_gauss,
             "numpy": torch.from_numpy(mt.astype(np.int64)), "numpy_pos": int(pos),
             "numpy_gauss": [int(has_gauss), float(gauss)], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), state["python_gauss"]))
    has_gauss, gauss = state["numpy_gauss"]
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32),
                         state["numpy_pos"], has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def is_lora(model) -> bool:
    return hasattr(model, "peft_config")


def rank_file(rank: int) -> str:
    return f"rank-{rank}"  # rank-R.json + rank-R.safetensors


class Checkpointer:
    def __init__(self, cfg, dp: Parallel, *, model, tokenizer, optimizer, task,
                 mirror=None, lock=None):
        self.cfg, self.dp, self.mirror, self.lock = cfg, dp, mirror, lock
        self.model, self.tokenizer, self.optimizer, self.task = model, tokenizer, optimizer, task
        self.out = Path(cfg.output_dir)
        self.root = self.out / "checkpoints"

    # ---------------------------------------------------------------- save

    def save(self, step: int, metrics_path: Path | None = None, extra: dict | None = None) -> Path:
        """Every rank calls this at the same step; returns the published folder. `extra`: more plain
        state for rank 0's trainer_state (e.g. the trackers' run ids)."""
        if not self.dp.active:
            def write(tmp: Path) -> None:
                self._write(tmp, step, metrics_path, extra)
                self._check_lock()

            with storage(f"checkpoint step-{step}", self.root):
                folder = ckpt.save(self.root, step, write, keep=self.cfg.save_total_limit)
        else:
            folder = self._save_together(step, metrics_path, extra)
        if self.mirror is not None:
            self.mirror.upload(folder)  # a snapshot; the upload runs in the background
        return folder

    def _save_together(self, step: int, metrics_path: Path | None, extra: dict | None) -> Path:
        """All ranks write into one scratch folder; each hashes and fsyncs a share of the files;
        rank 0 writes the manifest from those hashes after a barrier, then renames."""
        dp = self.dp
        what = f"checkpoint step-{step}"
        with storage(what, self.root):
            tmp = Path(dp.on_main(lambda: str(ckpt.begin(self.root, step))))

        # every rank's files are complete (together) before anyone hashes or publishes
        def write() -> dict:
            with storage(what, self.root):
                self._write(tmp, step, metrics_path, extra)
            return {}

        dp.together(write)
        names = ckpt.content_files(tmp)[dp.rank::dp.world]
        entries = ckpt.file_entries(tmp, names)
        ckpt.fsync_files(tmp / n for n in names)
        shares = {k: v for part in dp.gather(entries) for k, v in part.items()}

        def publish() -> str:
            self._check_lock()
            with storage(what, self.root):
                ckpt.write_manifest(tmp, step, files=shares)
                ckpt.fsync_tree(tmp, files=False)
                return str(ckpt.finish(self.root, tmp, step, keep=self.cfg.save_total_limit))

        return Path(dp.on_main(publish))

    def _check_lock(self) -> None:
        """Rank 0, before each publish: output_dir is still this run's (78 when another took it)."""
        if self.lock is not None:
            self.lock.check()

    def _write(self, tmp: Path, step: int, metrics_path: Path | None, extra: dict | None) -> None:
        dp, model = self.dp, self.model
        if dp.sharded:
            shards.save_sharded(model, self.optimizer, tmp / SHARDS, dp.rank,
                              trainable_only=is_lora(model))
        own = {"task": self.task.state_dict(), "rng": rng_state()}
        if not dp.is_main:
            ckpt.save_state(tmp, own, rank_file(dp.rank))
            return
        if not dp.sharded:
            if is_lora(model):
                model.save_pretrained(str(tmp / ADAPTER))
            else:
                save_pretrained(model, self.tokenizer, tmp)
            own["optimizer"] = shards.optimizer_state(model, self.optimizer)
        self.tokenizer.save_pretrained(str(tmp))
        model.config.save_pretrained(str(tmp))
        save_generation_config(model, tmp)
        ckpt.save_state(tmp, {"step": step, "world_size": dp.world, **own, **(extra or {})})
        (tmp / CONFIG_FILE).write_text(checkpoint_config(self.cfg))
        if metrics_path is not None and metrics_path.is_file():
            shutil.copyfile(metrics_path, tmp / METRICS)

    # ---------------------------------------------------------------- restore

    def restore(self, folder: Path) -> dict:
        """Weights, optimizer state, task state and RNGs from `folder` (any layout, any world size);
        returns rank 0's trainer state (step, trackers, ...). Every rank calls this. Contents that
        do not read as a checkpoint (past its manifest) set the folder aside on rank 0 and raise
        CheckpointDamaged on every rank: a restart resumes from the checkpoint before."""
        def restore() -> dict:
            try:
                return self._restore(folder)
            # a state file without what it must hold
            except (TensorFileError, KeyError, TypeError) as e:
                raise CheckpointDamaged(f"{folder}: {type(e).__name__}: {e}") from None

        try:
            return self.dp.together(restore)
        except CheckpointDamaged as e:
            if self.dp.is_main and folder.parent == self.root and folder.is_dir():
                ckpt.set_aside(folder, str(e))
            raise CheckpointDamaged(f"cannot resume from {folder}: {e}; it is set aside, run again "
                                    "to resume from the checkpoint before") from None

    def _restore(self, folder: Path) -> dict:
        state = ckpt.load_state(folder)
        saved_world = int(state.get("world_size", 1))
        if self.dp.world != saved_world:
            log.warning("resuming a %d-rank checkpoint on %d ranks: training continues, but not "
                        "bit "
                        "for bit as it would have at %d", saved_world, self.dp.world, saved_world)
        mine = self.dp.rank % saved_world
        own = state if mine == 0 else ckpt.load_state(folder, rank_file(mine))
        # the task state first: what it lacks, `prepare` computes from the base weights (DPO's
        # reference log-probs of an older checkpoint), before the checkpoint's weights replace them
        self.task.load_state_dict(own["task"])
        self.task.prepare(self.model)
        if (folder / SHARDS).is_dir():
            shards.load_sharded(self.model, self.optimizer, folder / SHARDS,
                              trainable_only=is_lora(self.model))
        else:
            load_weights(self.model, folder, self.optimizer, state.get("optimizer"))
        set_rng_state(own["rng"])
        return state

    # ---------------------------------------------------------------- final

    def write_final(self, step: int) -> Path:
        """final/: a Hugging Face model in model.dtype. The own module (LoRA merged tensor by
        tensor): sharded safetensors files (with their index when more than one), each written by
        the rank that gathers its tensors, one tensor at a time; else (the Hugging Face module)
        the whole state gathered to rank 0, which writes it. Atomic either way: every file goes
        into a scratch folder that rank 0 renames to final/ once every rank has written its
        share."""
        if not isinstance(base_module(self.model), CausalLM):
            return self._write_final_gathered(step)
        dp, tmp = self.dp, self.out / ".tmp-final"

        def begin() -> None:
            with storage("final/", self.out):
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)

        dp.on_main(begin)
        dtype = DTYPES[self.cfg.model.dtype]
        # sharded: the ranks split the files; else rank 0 holds the whole model and writes them all
        rank, world = (dp.rank, dp.world) if dp.sharded else (0, 1)

        def write() -> None:
            with storage("final/", self.out):
                write_weights(self.model, tmp, dtype, rank=rank, world=world)

        if dp.sharded:  # each rank its files; all are written when `together` returns
            dp.together(write)
        else:  # one process, or ddp: rank 0 holds the whole model
            dp.on_main(write)
        return Path(dp.on_main(lambda: self._publish_final(step, tmp)))

    def _publish_final(self, step: int, tmp: Path, *, other_files: bool = True) -> str:
        """Rank 0: the folder's files beside the weights (`other_files`), its manifest, then the
        rename to final/."""
        final = self.out / "final"
        with storage("final/", self.out):
            if other_files:
                save_folder_files(self.model, self.tokenizer, tmp, dtype=self.cfg.model.dtype)
            (tmp / CONFIG_FILE).write_text(checkpoint_config(self.cfg))
            ckpt.write_manifest(tmp, step)  # with the manifest's step: "complete"
            ckpt.fsync_tree(tmp)
            self._check_lock()
            ckpt.publish(tmp, final)
        if self.mirror is not None:  # the remote also gets the final model, as URL/final
            self.root.mkdir(parents=True, exist_ok=True)
            self.mirror.upload(final, scratch_root=self.root)
        return str(final)

    def _write_final_gathered(self, step: int) -> Path:
        """final/ of the Hugging Face module from the whole state on rank 0 (LoRA merged once):
        under FSDP every tensor is gathered to rank 0's host and a model built from it."""
        full = shards.model_state(self.model, full=True) if self.dp.sharded else None  # collective

        def write() -> str:
            tmp = self.out / ".tmp-final"
            shutil.rmtree(tmp, ignore_errors=True)
            model = self.model if full is None else fresh_model(self.cfg, full)
            with storage("final/", self.out):
                save_pretrained(model, self.tokenizer, tmp, dtype=self.cfg.model.dtype)
            return self._publish_final(step, tmp, other_files=False)

        return Path(self.dp.on_main(write))

    # ---------------------------------------------------------------- the remote mirror

    def upload_if_missing(self, step: int) -> None:
        """Rank 0: the end checkpoint, saved by an earlier process, sent again if the remote lacks
        it."""
        folder = self.root / f"step-{step}"
        if (
            self.mirror is None
            or not folder.is_dir()
            or self.mirror.reached(folder.name) != "never uploaded"
        ):
            return
        try:
            there = self.mirror.has(folder.name)
        except Unavailable as e:  # the end of the run says what did not reach the remote
            log.warning("%s", e)
            there = False
        if there:
            self.mirror.mark_uploaded(folder.name)  # already there: nothing to send
        else:
            log.info("%s is not at %s: uploading it again", folder.name, self.cfg.checkpoint_uri)
            self.mirror.upload(folder)

    def not_uploaded(self, step: int, problem: str | None) -> str | None:
        """Rank 0: what of the end checkpoint and final/ did not reach checkpoint_uri, or None."""
        if self.mirror is None:
            return None
        if problem is not None:
            bound = self.cfg.checkpoint_uri_timeout_seconds
            return f"the uploads to {self.cfg.checkpoint_uri} did not finish in {bound:.0f} s"
        for name in (f"step-{step}", "final"):
            why = self.mirror.reached(name)
            if why is not None:
                return f"{name} did not reach {self.cfg.checkpoint_uri} ({why})"
        return None

    def wait_uploads(self, stop) -> str | None:
        """Wait for rank 0's uploads, every rank in step (one small all-reduce a second): None when
        done; "preempted" when a signal came (to any rank) and the grace leaves no more time;
        "timeout" after checkpoint_uri_timeout_seconds. No wait is unbounded."""
        if not self.cfg.checkpoint_uri:
            return None
        local = getattr(stop, "stop", stop)  # this rank's handler (under SharedStop: its inner one)
        start = time.monotonic()
        logged = False
        while True:
            done = self.mirror.wait(1.0) if self.mirror is not None else True
            timed_out = time.monotonic() - start > self.cfg.checkpoint_uri_timeout_seconds
            flags = [float(not done), float(local.requested), local.elapsed(), float(timed_out)]
            left, requested, elapsed, timed_out = self.dp.max(*flags) if self.dp.active else flags
            if not left:
                return None
            if requested and elapsed > local.grace - UPLOAD_MARGIN_S:
                log.warning("uploads to %s still running, and the grace period is spent: stopping "
                            "(the remote keeps its previous complete checkpoint)",
                            self.cfg.checkpoint_uri)
                return "preempted"
            if timed_out:
                log.warning("uploads to %s still running after %.0f s: giving up",
                            self.cfg.checkpoint_uri, self.cfg.checkpoint_uri_timeout_seconds)
                return "timeout"
            if not logged:
                log.info("waiting for the uploads to %s", self.cfg.checkpoint_uri)
                logged = True



@contextlib.contextmanager
def storage(what: str, where: Path):
    """A failed write (a full disk, a read-only or lost volume) as one line with its errno: exit 69
    (storage unavailable; the checkpoints published before are whole, a restart resumes from
    them)."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, SafetensorError) as e:
        raise Unavailable(f"cannot write {what} in {where}: {one_line(e)}; "
                          "the checkpoints before it are intact") from None


def fresh_model(cfg, weights: dict):
    """A plain (unsharded, CPU) policy of `cfg` holding `weights` (whole tensors keyed by name)."""
    model = load_model(cfg.model, cfg.model.name_or_path)
    check_fit(model, *model.load_state_dict(weights, strict=False), where="weights")
    return model


def check_fit(model, missing, unexpected, *, where: str) -> None:
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or [
        k for k in missing if k not in tied and "lm_head" not in k and "lora_" not in k
    ]:
        raise UserError(f"checkpoint weights do not fit the model (missing {list(missing)[:3]}, "
                        f"unexpected {list(unexpected)[:3]})", where=where)


def read_weights(model, folder: Path) -> dict:
    """Whole-tensor weights of a full-layout checkpoint, keyed by the model's parameter names: the
    LoRA adapter when there is one, else the full model. Damage raises TensorFileError."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if is_lora(model):
        from peft.utils.save_and_load import _insert_adapter_name_into_state_dict

        f = folder / ADAPTER / "adapter_model.safetensors"
        if not f.is_file():
            raise UserError("checkpoint has no LoRA adapter", where=str(folder))
        files = [f]
    else:
        try:
            files = weight_files(folder)
        except ValueError as e:
            raise TensorFileError(str(e)) from None
        if not files:
            raise UserError("checkpoint has no model weights", where=str(folder))
    state = {}
    try:
        for f in files:
            state.update(load_file(str(f)))
    except (OSError, SafetensorError) as e:
        raise TensorFileError(f"{f.name} is not readable: {e}") from None
    return (
        _insert_adapter_name_into_state_dict(state, "default", "lora_") if is_lora(model) else state
    )


def load_weights(model, folder: Path, optimizer=None, optim_state: dict | None = None) -> None:
    """Weights of a full-layout checkpoint (and optimizer state) into a model of any strategy."""
    missing, unexpected = shards.load_full_state(model, optimizer,
                                               read_weights(model, folder), optim_state)
    if not is_lora(model):
        check_fit(model, missing, unexpected, where=str(folder))
