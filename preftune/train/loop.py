"""The run: set up, resume, step, log, evaluate, checkpoint, and stop cleanly on preemption.

The loop owns the optimizer, the schedule, logging, checkpoints and the stop flag; a *task*
(`GRPOTask`, `DPOTask`) owns its data order and does one step's forward/backward.

Exact resume: a checkpoint at step N holds everything step N+1 reads (weights, optimizer moments,
every RNG, the task's data position and pending batch, the metrics so far), and the LR is a pure
function of the step, so a resumed run repeats the uninterrupted one bit for bit on the same device.
"""
from __future__ import annotations

import logging
import os
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from preftune.config import Config, to_yaml
from preftune.errors import Preempted
from preftune.models import load_model, load_tokenizer, resolve_model_path
from preftune.train import checkpoint as ckpt
from preftune.train import distributed
from preftune.train.checkpointer import METRICS, Checkpointer, load_weights, rng_state, set_rng_state  # noqa: F401
from preftune.train.distributed import Parallel, SharedStop
from preftune.train.evaluate import build_evaluator
from preftune.train.metrics import MetricsLog
from preftune.train.optim import build_optimizer, lr_at, set_lr
from preftune.train.preemption import Preemption, StepAbandoned
from preftune.train.resume import find_resume_point

log = logging.getLogger("preftune")
UPLOAD_MARGIN_S = 5.0  # of the grace period, kept for exiting after the last upload wait


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def build_task(cfg: Config, model, tokenizer, device, dp: Parallel | None = None):
    dp = dp or Parallel()
    if cfg.algorithm == "grpo":
        from preftune.train.grpo_task import GRPOTask

        return GRPOTask(cfg, model, tokenizer, device, dp)
    from preftune.train.dpo import DPOTask

    return DPOTask(cfg, model, tokenizer, device, dp)


def _copy_atomic(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".tmp")
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


class Run:
    def __init__(self, cfg: Config, dp: Parallel | None = None):
        self.cfg = cfg
        self.dp = dp = dp or Parallel()
        self.out = Path(cfg.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.device = dp.device
        self.mirror = ckpt.RemoteMirror(cfg.checkpoint_uri, cfg.save_total_limit) \
            if cfg.checkpoint_uri and dp.is_main else None
        # rank 0 decides (it may set damaged checkpoints aside or download one) and tells the others
        found = dp.on_main(lambda: self._setup_folder())
        self.resumed_from = Path(found) if found else None
        seed_everything(cfg.seed)
        base_path = resolve_model_path(cfg.model, cfg.config_dir)
        self.tokenizer = load_tokenizer(base_path, cfg.model.trust_remote_code)
        mixed = cfg.model.dtype == "bfloat16" and not cfg.model.lora.enabled
        self.model = dp.wrap(load_model(cfg.model, base_path), mixed_bf16=mixed,
                             reshard_after_forward=cfg.distributed.reshard_after_forward)
        # built from the base weights, before the restore: DPO's cached reference log-probs need them
        self.task = build_task(cfg, self.model, self.tokenizer, self.device, dp)
        self.evaluator = build_evaluator(cfg, self.tokenizer)
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad], cfg.optim)
        self.checkpointer = Checkpointer(cfg, dp, model=self.model, tokenizer=self.tokenizer,
                                         optimizer=self.optimizer, task=self.task, mirror=self.mirror)
        self.step = 0
        if self.resumed_from is not None:
            self._restore(self.resumed_from)
        self.saved_step = self.step  # the newest state that a resume would reproduce
        self.metrics = None
        if dp.is_main:
            (self.out / "config.yaml").write_text(to_yaml(cfg))
            # a fresh start drops every old record; a resume keeps those up to its checkpoint
            self.metrics = MetricsLog(self.out, total_steps=cfg.max_steps, start_step=self.step if self.step else -1,
                                      progress=cfg.log.progress_bar,
                                      tensorboard="tensorboard" in cfg.log.report_to)

    def _setup_folder(self) -> str | None:
        found = find_resume_point(self.cfg, self.out, self.ckpt_root, self.mirror)
        self.out.mkdir(parents=True, exist_ok=True)
        ckpt.clean_stale(self.ckpt_root)
        return str(found) if found is not None else None

    def _restore(self, folder: Path) -> None:
        self.step = self.checkpointer.restore(folder)
        if self.dp.is_main and (folder / METRICS).is_file():  # the records as they were at the save
            _copy_atomic(folder / METRICS, self.out / METRICS)
        log.info("resumed from %s (step %d)", folder, self.step)

    def _save(self) -> Path:
        if self.metrics is not None:
            self.metrics.file.flush()
        folder = self.checkpointer.save(self.step, self.out / METRICS)
        self.saved_step = self.step
        return folder

    def _log(self, m: dict, **kw) -> None:
        if self.metrics is not None:  # rank 0 writes; every rank holds the same reduced metrics
            self.metrics.log(self.step, m, **kw)

    def _eval(self) -> None:
        if self.evaluator is not None:
            with self.dp.gathered(self.model):  # each rank evaluates the whole set; rank 0 logs it
                self._log(self.evaluator(self.model, self.step))

    def _one_step(self, stop: Preemption) -> dict:
        self.step += 1
        lr = lr_at(self.step, self.cfg.max_steps, self.cfg.optim)
        set_lr(self.optimizer, lr)
        t0 = time.perf_counter()
        m = self.task.step(self.model, self.step, stop)
        self.dp.sync_grads(self.model)
        m["grad_norm"] = self.dp.clip_and_step(self.model, self.optimizer, self.cfg.optim.max_grad_norm)
        m["learning_rate"] = lr
        m["step_time"] = time.perf_counter() - t0
        m["tokens_per_second"] = m.pop("num_tokens", 0) / max(m["step_time"], 1e-9)
        return m

    def _try_step(self, stop: Preemption) -> dict | None:
        """One step, or None when preemption abandoned it; then everything it touched (data
        position, pending batch, RNG, gradients) is rolled back to the last finished step."""
        task_state, rng = self.task.state_dict(), rng_state()
        try:
            return self._one_step(stop)
        except StepAbandoned:
            self.step -= 1
            self.optimizer.zero_grad(set_to_none=True)
            self.task.load_state_dict(task_state)
            set_rng_state(rng)
            log.warning("step %d abandoned: the grace period is too short to finish it", self.step + 1)
            return None

    def run(self, stop: Preemption | None = None) -> Path:
        if stop is None:
            with Preemption(self.cfg.preemption_grace_seconds) as stop:
                return self.run(stop)
        if self.dp.active:
            stop = SharedStop(stop, self.dp)
        cfg = self.cfg
        if self.resumed_from is None:
            self._eval()  # step 0; a resumed run has this record already
        stop.training()
        while self.step < cfg.max_steps and not stop.requested:
            m = self._try_step(stop)
            if m is None:
                break
            if self.step % cfg.log.logging_steps == 0 or self.step == cfg.max_steps:
                self._log(m, advance=True)
            elif self.metrics is not None and self.metrics.bar is not None:
                self.metrics.bar.update(1)
            if cfg.eval.eval_steps and self.step % cfg.eval.eval_steps == 0 and self.step < cfg.max_steps:
                self._eval()
            if cfg.save_steps and self.step % cfg.save_steps == 0:
                self._save()
        if stop.requested and self.step < cfg.max_steps:
            self._stop(stop)
        self._eval()
        final = self._write_final()
        self._finish_uploads(None)
        self._close_metrics()
        return final

    def _close_metrics(self) -> None:
        if self.metrics is not None:
            self.metrics.close()

    def _stop(self, stop: Preemption) -> None:
        """Save (unless the newest checkpoint already is this state), flush uploads, raise Preempted."""
        stop.saving = True
        if self.step != self.saved_step:
            folder = self._save()
            what = f"checkpoint {folder.name} saved"
        else:
            what = "nothing new since the last checkpoint" if self.step else "nothing trained yet"
        self._finish_uploads(max(0.0, stop.remaining() - UPLOAD_MARGIN_S))
        self._close_metrics()
        raise Preempted(f"preempted at step {self.step}; {what}; resume to continue")

    def _write_final(self) -> Path:
        return self.checkpointer.write_final(self.step)

    def _finish_uploads(self, timeout: float | None) -> None:
        if self.mirror is not None and not self.mirror.wait(timeout):
            log.warning("checkpoint upload to %s still running after %.0f s; stopping anyway (the remote "
                        "keeps its previous complete checkpoint)", self.cfg.checkpoint_uri, timeout or 0)


def train(cfg: Config) -> Path:
    """Set up and run under one signal handler: a signal during setup stops at once (exit 75,
    nothing to save); during training it stops at the next step boundary with a checkpoint."""
    with Preemption(cfg.preemption_grace_seconds) as stop:
        dp = distributed.init(cfg.distributed)
        try:
            dp.require_divisible({"grpo.prompts_per_step": cfg.grpo.prompts_per_step} if cfg.algorithm == "grpo"
                                 else {"dpo.batch_size": cfg.dpo.batch_size})
            return Run(cfg, dp).run(stop)
        finally:
            dp.close()
