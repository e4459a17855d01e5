"""The run: set up, resume, step, log, evaluate, checkpoint, and stop cleanly on preemption.

The loop owns the optimizer, the schedule, logging, checkpoints and the stop flag; a *task*
(`GRPOTask`, `DPOTask`, `KTOTask`, `SFTTask`) owns its data order and does one step's
forward/backward.

Exact resume: a checkpoint at step N holds everything step N+1 reads (weights, optimizer moments,
every RNG, the task's data position and pending batch, the metrics so far), and the LR is a pure
function of the step, so a resumed run repeats the uninterrupted one bit for bit on the same device.
"""
from __future__ import annotations

import contextlib
import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from preftune.atomic import atomic_write, copy_atomic
from preftune.config import Config, to_dict, to_yaml
from preftune.config.redact import redact
from preftune.data.data_report import write_data_report
from preftune.errors import Preempted, Unavailable
from preftune.model.load import check_model_path, import_model_libraries, load_tokenizer
from preftune.run import checkpoint_folders as ckpt, optim
from preftune.run.checkpointer import METRICS, Checkpointer, rng_state, set_rng_state
from preftune.algorithms.dpo import DPOTask
from preftune.algorithms.grpo import GRPOTask
from preftune.algorithms.kto import KTOTask
from preftune.algorithms.sft import SFTTask
from preftune.algorithms.task import Task
from preftune.distributed.group import Parallel, init as init_group
from preftune.evaluation.evaluate import build_evaluator
from preftune.run.callbacks import Callbacks
from preftune.run.completion import completed
from preftune.run.determinism import enable_full_determinism
from preftune.run.host_memory import keep_freed_memory
from preftune.run.loggers import build_trackers
from preftune.run.metrics import MetricsLog, Window
from preftune.run.optim import build_optimizer, lr_at, set_lr
from preftune.run.lock import RunLock
from preftune.run.mirror import RemoteMirror
from preftune.run.outdir import OutputGuard
from preftune.run.preemption import Preemption, SharedStop, StepAbandoned, process_handler
from preftune.run.resume import find_resume_point, record_changes
from preftune.run.startup import StartupClock, process_start
from preftune.distributed import fsdp

log = logging.getLogger("preftune")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass(frozen=True)
class Algorithm:
    task: type  # a `Task` (algorithms/task.py)
    batch_key: str  # the global batch, which splits evenly over the ranks


# the one table of algorithms: config.algorithm's choices
ALGORITHMS = {"grpo": Algorithm(GRPOTask, "grpo.prompts_per_step"),
              "dpo": Algorithm(DPOTask, "dpo.batch_size"),
              "kto": Algorithm(KTOTask, "kto.batch_size"),
              "sft": Algorithm(SFTTask, "sft.batch_size")}


def build_task(cfg: Config, model, tokenizer, device, dp: Parallel) -> Task:
    return ALGORITHMS[cfg.algorithm].task(cfg, model, tokenizer, device, dp)


class Run:
    """Setup validates and builds everything (model, data, reward functions, eval set) before it
    writes to output_dir; `train()` also guards the folder until the first step (run/outdir.py)."""

    on_first_step = None  # called once the first optimizer step has been taken
    startup: dict = {}  # startup_seconds by phase, until the first training record carries them

    def __init__(self, cfg: Config, dp: Parallel, *, callbacks=(),
                 clock: StartupClock | None = None, lock: RunLock | None = None):
        # lock: rank 0's hold on output_dir (run/lock.py), else None
        self.cfg, self.lock = cfg, lock
        self.dp = dp
        self.clock = clock = clock or StartupClock()
        # functions cb(step, record) and TrainerCallbacks (run/callbacks.py), on rank 0
        self.callbacks = (
            callbacks if isinstance(callbacks, Callbacks) else Callbacks(callbacks, cfg)
        )
        if not dp.is_main:
            self.callbacks = Callbacks((), cfg)
        self.window, self.num_tokens = Window(), 0  # the steps since the last record; tokens seen
        self.tracker_state: dict | None = None  # tracker run ids from the checkpoint
        self.evaluated: int | None = None  # the step of the latest evaluation
        self.out = Path(cfg.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.device = dp.device
        if self.device.type == "cpu":  # activations live in host memory: reuse it from step to step
            keep_freed_memory()
        self.mirror = RemoteMirror(cfg.checkpoint_uri, cfg.save_total_limit,
                                   cfg.checkpoint_uri_timeout_seconds) \
            if cfg.checkpoint_uri and dp.is_main else None
        # rank 0 decides (it may set damaged checkpoints aside or download one) and tells the others
        found = dp.on_main(lambda: find_resume_point(cfg, self.out, self.ckpt_root, self.mirror))
        self.resumed_from = Path(found) if found else None
        clock.mark("restore")
        seed_everything(cfg.seed)
        if cfg.full_determinism:
            enable_full_determinism(self.device)
        base_path = check_model_path(cfg.model.name_or_path)
        self.tokenizer = load_tokenizer(base_path, cfg.model.trust_remote_code)
        self.model = fsdp.load(dp, cfg.model, base_path,
                             reshard_after_forward=cfg.distributed.reshard_after_forward)
        clock.mark("model")
        self.task = build_task(cfg, self.model, self.tokenizer, self.device, dp)
        self.evaluator = self.task.evaluator() or build_evaluator(
            cfg, self.tokenizer, dp, engine=self.task.engine, agent=self.task.agent)
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad],
                                         cfg.optim)
        self.callbacks.bind(model=self.model, processing_class=self.tokenizer,
                            optimizer=self.optimizer)
        self.checkpointer = Checkpointer(cfg, dp, model=self.model, tokenizer=self.tokenizer,
                                         optimizer=self.optimizer,
                                         task=self.task, mirror=self.mirror, lock=lock)
        if dp.is_main:
            self.out.mkdir(parents=True, exist_ok=True)  # everything above is validated: now write
            ckpt.clean_stale(self.ckpt_root)
            write_data_report(self.out, self.task.data_report)
        dp.barrier()  # the folder exists before any rank writes into it
        self.step = 0
        if self.resumed_from is not None:
            self._restore(self.resumed_from)
        else:
            self.task.prepare(self.model)
        clock.mark("data")
        self.saved_step = self.step  # the newest state that a resume would reproduce
        self.metrics = None
        if not dp.is_main:  # rank 0 writes metrics, reports and the progress bar
            return
        atomic_write(self.out / "config.yaml", to_yaml(cfg))
        if self.resumed_from is not None:  # what this resume changed (checked in find_resume_point)
            record_changes(self.out, self.resumed_from, self.step, cfg)
        # a fresh start drops every old record; a resume keeps those up to its checkpoint
        start = self.step if self.step else -1
        trackers = build_trackers(cfg.log.report_to, self.out, config=redact(to_dict(cfg)),
                                  project=cfg.log.project,
                                  run_name=cfg.log.run_name, start_step=start,
                                  state=self.tracker_state, on_outage=cfg.log.on_tracker_outage)
        self.metrics = MetricsLog(self.out, total_steps=cfg.max_steps, start_step=start,
                                  progress=cfg.log.progress_bar, trackers=trackers)

    def _restore(self, folder: Path) -> None:
        self.clock.mark("data")
        state = self.checkpointer.restore(folder)
        self.step = int(state["step"])
        self.tracker_state = state.get("trackers")
        self.window, self.num_tokens = (
            Window(state.get("log_window")),
            int(state.get("num_tokens", 0)),
        )
        if self.dp.is_main and (folder / METRICS).is_file():  # the records as they were at the save
            copy_atomic(folder / METRICS, self.out / METRICS)
        log.info("resumed from %s (step %d)", folder, self.step)
        self.clock.mark("restore")

    def _save(self) -> Path:
        extra, path = {}, None
        if self.metrics is not None:
            self.metrics.file.flush()
            extra, path = {"trackers": self.metrics.state_dict(),
                           "log_window": self.window.state_dict(),
                           "num_tokens": self.num_tokens}, self.metrics.path
        folder = self.checkpointer.save(self.step, path, extra)
        self.saved_step = self.step
        self.callbacks.event("on_save", self.step)
        return folder

    def _eval(self) -> None:
        # an early stop may follow an eval
        if self.evaluator is not None and self.evaluated != self.step:
            # each rank evaluates its share of the prompts; rank 0 logs
            with fsdp.whole(self.model):
                m = self.evaluator(self.model, self.step)
            self._log(m)
            self.evaluated = self.step

    def _log(self, m: dict, advance: bool = False) -> None:
        # the first training record of this process carries startup_seconds
        if advance and self.startup:
            m, self.startup = m | self.startup, {}
        if self.metrics is None:  # not rank 0: every rank holds the same reduced metrics
            return
        record = self.metrics.log(self.step, m, advance=advance)
        self.callbacks.log(self.step, {k: v for k, v in record.items() if k != "step"},
                           evaluation=not advance)

    def _one_step(self, stop: Preemption) -> dict:
        self.step += 1
        lr = lr_at(self.step, self.cfg.max_steps, self.cfg.optim)
        set_lr(self.optimizer, lr)
        t0 = time.perf_counter()
        m = self.task.step(self.model, self.step, stop)
        fsdp.sync_grads(self.dp, self.model)
        m["grad_norm"] = fsdp.clip_grads(self.dp, self.model, self.cfg.optim.max_grad_norm)
        optim.step(self.optimizer)
        m["learning_rate"] = lr
        m["step_time"] = time.perf_counter() - t0
        tokens = m.pop("num_tokens", 0)
        m["tokens_per_second"] = tokens / max(m["step_time"], 1e-9)
        self.num_tokens += int(tokens)
        m["num_tokens"] = self.num_tokens  # TRL's: prompt and completion tokens seen so far
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
            log.warning("step %d abandoned: the grace period is too short to finish it",
                        self.step + 1)
            return None

    def run(self, stop: Preemption | None = None) -> Path:
        if stop is None:
            with Preemption(self.cfg.preemption_grace_seconds) as stop:
                return self.run(stop)
        if self.dp.active:
            stop = SharedStop(stop, self.dp)
        try:
            return self._run(stop)
        except BaseException:
            # else the trackers' run is another process's now
            if self.lock is None or self.lock.held:
                self._close_metrics("failed")  # no-op after a preemption closed it
            raise

    def _close_metrics(self, status: str | None = None) -> None:
        if self.metrics is not None:
            self.metrics.close(status) if status else self.metrics.close()

    def _callback_stop(self) -> bool:
        """A callback (rank 0's) asked to stop, or rank 0 lost its lock on output_dir (the save that
        follows refuses to publish, exit 78): every rank stops at the same step."""
        asked = self.callbacks.stop or (self.lock is not None and not self.lock.held)
        return self.dp.any(asked) if self.dp.active else asked

    def _run(self, stop: Preemption) -> Path:
        cfg = self.cfg
        self.callbacks.event("on_train_begin", self.step)
        if self.resumed_from is None:
            self._eval()  # step 0; a resumed run has this record already
        self.clock.mark("eval")
        self.startup = self.clock.report()
        stop.training()
        while self.step < cfg.max_steps and not stop.requested and not self._callback_stop():
            self.callbacks.event("on_step_begin", self.step)
            m = self._try_step(stop)
            if m is None:
                break
            self.callbacks.event("on_step_end", self.step)
            if self.on_first_step is not None:
                self.on_first_step()
                self.on_first_step = None
            self.window.add(m)
            if self.step % cfg.log.logging_steps == 0 or self.step == cfg.max_steps:
                self._log(self.window.take(), advance=True)  # the window's mean, as TRL logs
            elif self.metrics is not None and self.metrics.bar is not None:
                self.metrics.bar.update(1)
            if (
                cfg.eval.eval_steps
                and self.step % cfg.eval.eval_steps == 0
                and self.step < cfg.max_steps
            ):
                self._eval()
            if cfg.save_steps and self.step % cfg.save_steps == 0:
                self._save()
        if stop.requested and self.step < cfg.max_steps:
            self._stop(stop)
        return self._finish(stop)

    def _finish(self, stop: Preemption) -> Path:
        """The end checkpoint (the complete trainer state, even with save_steps 0: a larger
        max_steps, or a resume after a callback's early stop, continues from it), the final
        evaluation, final/, the uploads; then the run is complete and a signal changes nothing. A
        signal in between lets this finish (bounded work; the end checkpoint makes a kill cost only
        the final evaluation). With checkpoint_uri the run is done only when the end checkpoint and
        final/ are there: else exit 75 after a signal (the grace ran out), 69 when the remote failed
        or did not answer."""
        stop.saving = True
        if self.step != self.saved_step:
            self._save()
        else:
            # a rerun after a failed upload: send it again
            self.dp.on_main(lambda: self.checkpointer.upload_if_missing(self.step))
        # while the end checkpoint uploads; final/ must not supersede it in the mirror's queue
        self._eval()
        problem = self.checkpointer.wait_uploads(stop)
        final = self._write_final() if problem != "preempted" else None
        if problem is None:
            problem = self.checkpointer.wait_uploads(stop)
        if problem == "preempted":
            self._close_metrics("preempted")
            raise Preempted(f"preempted at step {self.step} while uploading to "
                            f"{self.cfg.checkpoint_uri}; run again to finish")
        missing = self.dp.on_main(lambda: self.checkpointer.not_uploaded(self.step, problem))
        if missing:
            self._close_metrics("failed")
            raise Unavailable(f"the run finished at step {self.step} (model in "
                              f"{final}), but {missing}; run again to upload "
                              "(the run resumes from its end checkpoint)")
        self.callbacks.event("on_train_end", self.step)
        stop.complete()
        self._close_metrics()
        return final

    def _stop(self, stop: Preemption) -> None:
        """Save (unless the newest checkpoint already is this state), flush uploads, raise
        Preempted."""
        stop.saving = True
        if self.step != self.saved_step:
            folder = self._save()
            what = f"checkpoint {folder.name} saved"
        else:
            what = "nothing new since the last checkpoint" if self.step else "nothing trained yet"
        self.checkpointer.wait_uploads(stop)
        self._close_metrics("preempted")
        raise Preempted(f"preempted at step {self.step}; {what}; resume to continue")

    def _write_final(self) -> Path:
        return self.checkpointer.write_final(self.step)


def train(cfg: Config, *, callbacks=()) -> Path:
    """Set up and run under one signal handler: a signal during setup stops at once (exit 75,
    nothing to save); during training it stops at the next step boundary with a checkpoint; once
    the outputs are complete it changes nothing. In the `preftune` process the handler is the
    process's own (installed at its first line, kept to its exit); otherwise it is installed for
    this call and the handlers in place before are restored when it returns or raises. Until the
    first optimizer step, output_dir is guarded: an error leaves it as it was found
    (run/outdir.py). A run whose outputs are already complete returns its final/ untouched."""
    stop = process_handler()
    if stop is None:
        with Preemption(cfg.preemption_grace_seconds) as stop:
            return _train(cfg, stop, StartupClock(), callbacks)
    return _train(cfg, stop, StartupClock(process_start()), callbacks)


def _train(cfg: Config, stop: Preemption, clock: StartupClock, callbacks) -> Path:
    done = completed(cfg)
    if done is not None:
        log.info("already complete: %s; nothing to do", done)
        stop.complete()
        return Path(cfg.output_dir) / "final"
    import_model_libraries(cfg.model)  # start-up still: a signal here ends the process at once
    clock.mark("imports")
    stop.setup(cfg.preemption_grace_seconds)
    dp = init_group(cfg.distributed)  # one plain process without torchrun's environment
    lock = None
    try:
        check_parallel(cfg, dp)
        # rank 0 owns output_dir: only it locks, guards (and may roll back) the folder
        guard = (
            OutputGuard(Path(cfg.output_dir), lambda: lock is None or lock.held)
            if dp.is_main
            else None
        )
        try:
            lock = dp.on_main(lambda: RunLock(Path(cfg.output_dir),
                                              cfg.lock_stale_seconds).acquire(), share=False)
        except BaseException:
            if guard is not None:
                guard.commit()  # nothing was touched: only drop the snapshot
            raise
        with guard or contextlib.nullcontext():
            run = Run(cfg, dp, callbacks=callbacks, clock=clock, lock=lock)
            run.on_first_step = getattr(guard, "commit", None)
            final = run.run(stop)
        dp.barrier()  # no rank tears the process group down while another still uses it
        return final
    except Preempted:
        if not stop.immediate:  # in training every rank stops at the same boundary, after one save;
            # a signal during setup stops only its rank (the others fail at a collective)
            dp.barrier()
        raise
    finally:
        if lock is not None:
            lock.release()
        dp.close()


def check_parallel(cfg: Config, dp: Parallel) -> None:
    """The global batch splits evenly over the ranks (exit 78 naming the key otherwise)."""
    if dp.world == 1:
        return
    key = ALGORITHMS[cfg.algorithm].batch_key
    section, name = key.split(".")
    dp.require_divisible({key: getattr(getattr(cfg, section), name)})
