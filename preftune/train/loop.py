"""The run: set up, resume, step, log, evaluate, checkpoint, and stop cleanly on preemption.

The loop owns the optimizer, the schedule, logging, checkpoints and the stop flag; a *task*
(`GRPOTask`, `DPOTask`) owns its data order and does one step's forward/backward.

Exact resume: a checkpoint at step N holds everything step N+1 reads (weights, optimizer moments,
every RNG, the task's data position and pending batch, the metrics so far), and the LR is a pure
function of the step, so a resumed run repeats the uninterrupted one bit for bit on the same device.
"""
from __future__ import annotations

import logging
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from preftune.atomic import atomic_write, copy_atomic
from preftune.config import Config, to_dict, to_yaml
from preftune.data.report import write_data_report
from preftune.errors import Preempted, UserError
from preftune.models import check_model_path, import_model_libraries, load_model, load_tokenizer, save_pretrained
from preftune.train import checkpoint as ckpt
from preftune.train.evaluate import build_evaluator
from preftune.train.loggers import build_trackers
from preftune.train.metrics import MetricsLog
from preftune.train.optim import build_optimizer, clip_and_step, lr_at, set_lr
from preftune.train.outdir import OutputGuard
from preftune.train.preemption import Preemption, StepAbandoned, process_handler
from preftune.train.resume import CONFIG_FILE, checkpoint_config, find_resume_point
from preftune.train.startup import StartupClock, process_start

log = logging.getLogger("preftune")
METRICS = "metrics.jsonl"
UPLOAD_MARGIN_S = 5.0  # of the grace period, kept for exiting after the last upload wait


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """Every global RNG as plain tensors/ints/floats (loadable with weights_only=True)."""
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
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def build_task(cfg: Config, model, tokenizer, device):
    if cfg.algorithm == "grpo":
        from preftune.train.grpo_task import GRPOTask

        return GRPOTask(cfg, model, tokenizer, device)
    if cfg.algorithm == "sft":
        from preftune.train.sft import SFTTask

        return SFTTask(cfg, model, tokenizer, device)
    from preftune.train.dpo import DPOTask

    return DPOTask(cfg, model, tokenizer, device)


class Run:
    """Setup validates and builds everything (model, data, reward functions, eval set) before it
    writes to output_dir; `train()` also guards the folder until the first step (train/outdir.py)."""

    on_first_step = None  # called once the first optimizer step has been taken
    startup: dict = {}  # startup_seconds by phase, until the first training record carries them

    def __init__(self, cfg: Config, *, callbacks=(), clock: StartupClock | None = None):
        self.cfg = cfg
        self.clock = clock = clock or StartupClock()
        # called as cb(step, record) after each logged record; returning True stops the run at this step
        self.callbacks = list(callbacks)
        self.stop_asked = False
        self.tracker_state: dict | None = None  # tracker run ids from the checkpoint
        self.evaluated: int | None = None  # the step of the latest evaluation
        self.out = Path(cfg.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.mirror = ckpt.RemoteMirror(cfg.checkpoint_uri, cfg.save_total_limit) if cfg.checkpoint_uri else None
        self.resumed_from = find_resume_point(cfg, self.out, self.ckpt_root, self.mirror)
        clock.mark("restore")
        seed_everything(cfg.seed)
        base_path = check_model_path(cfg.model.name_or_path)
        self.tokenizer = load_tokenizer(base_path, cfg.model.trust_remote_code)
        self.model = load_model(cfg.model, base_path).to(self.device)
        clock.mark("model")
        self.task = build_task(cfg, self.model, self.tokenizer, self.device)
        self.evaluator = build_evaluator(cfg, self.tokenizer)
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad], cfg.optim)
        self.out.mkdir(parents=True, exist_ok=True)  # everything above is validated: now write
        ckpt.clean_stale(self.ckpt_root)
        write_data_report(self.out, self.task.data_report)
        self.step = 0
        if self.resumed_from is not None:
            self._restore(self.resumed_from)
        else:
            self.task.prepare(self.model)
        clock.mark("data")
        self.saved_step = self.step  # the newest state that a resume would reproduce
        atomic_write(self.out / "config.yaml", to_yaml(cfg))
        # a fresh start drops every old record; a resume keeps those up to its checkpoint
        start = self.step if self.step else -1
        trackers = build_trackers(cfg.log.report_to, self.out, config=to_dict(cfg), project=cfg.log.project,
                                  run_name=cfg.log.run_name, start_step=start, state=self.tracker_state)
        self.metrics = MetricsLog(self.out, total_steps=cfg.max_steps, start_step=start,
                                  progress=cfg.log.progress_bar, trackers=trackers)

    def _restore(self, folder: Path) -> None:
        """The task state first: what it lacks, `prepare` computes from the base weights (DPO's
        reference log-probs of an older checkpoint), before the checkpoint's weights replace them."""
        self.clock.mark("data")
        state = ckpt.load_state(folder)
        self.task.load_state_dict(state["task"])
        self.clock.mark("restore")
        self.task.prepare(self.model)
        self.clock.mark("data")
        load_weights(self.model, folder)
        self.optimizer.load_state_dict(state["optimizer"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        self.tracker_state = state.get("trackers")
        if (folder / METRICS).is_file():  # the records as they were at the save, even into an empty output_dir
            copy_atomic(folder / METRICS, self.out / METRICS)
        log.info("resumed from %s (step %d)", folder, self.step)
        self.clock.mark("restore")

    def _save(self) -> Path:
        def write(tmp: Path) -> None:
            save_pretrained(self.model, self.tokenizer, tmp)
            if hasattr(self.model, "peft_config"):
                self.model.save_pretrained(str(tmp / "adapter"))
            ckpt.save_state(tmp, {"step": self.step, "optimizer": self.optimizer.state_dict(),
                                  "task": self.task.state_dict(), "rng": rng_state(),
                                  "trackers": self.metrics.state_dict()})
            (tmp / CONFIG_FILE).write_text(checkpoint_config(self.cfg))
            self.metrics.file.flush()
            shutil.copyfile(self.metrics.path, tmp / METRICS)

        folder = ckpt.save(self.ckpt_root, self.step, write, keep=self.cfg.save_total_limit)
        self.saved_step = self.step
        if self.mirror is not None:
            self.mirror.upload(folder)  # a snapshot; the upload runs in the background
        return folder

    def _eval(self) -> None:
        if self.evaluator is not None and self.evaluated != self.step:  # an early stop may follow an eval
            self._log(self.evaluator(self.model, self.step))
            self.evaluated = self.step

    def _log(self, m: dict, advance: bool = False) -> None:
        if advance and self.startup:  # the first training record of this process carries startup_seconds
            m, self.startup = m | self.startup, {}
        record = self.metrics.log(self.step, m, advance=advance)
        for cb in self.callbacks:
            if cb(self.step, {k: v for k, v in record.items() if k != "step"}) is True:
                self.stop_asked = True

    def _one_step(self, stop: Preemption) -> dict:
        self.step += 1
        lr = lr_at(self.step, self.cfg.max_steps, self.cfg.optim)
        set_lr(self.optimizer, lr)
        t0 = time.perf_counter()
        m = self.task.step(self.model, self.step, stop)
        m["grad_norm"] = clip_and_step(self.model, self.optimizer, self.cfg.optim.max_grad_norm)
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
        try:
            return self._run(stop)
        except BaseException:
            self.metrics.close("failed")  # no-op after a preemption closed it
            raise

    def _run(self, stop: Preemption) -> Path:
        cfg = self.cfg
        if self.resumed_from is None:
            self._eval()  # step 0; a resumed run has this record already
        self.clock.mark("eval")
        self.startup = self.clock.report()
        stop.training()
        while self.step < cfg.max_steps and not stop.requested and not self.stop_asked:
            m = self._try_step(stop)
            if m is None:
                break
            if self.on_first_step is not None:
                self.on_first_step()
                self.on_first_step = None
            if self.step % cfg.log.logging_steps == 0 or self.step == cfg.max_steps:
                self._log(m, advance=True)
            elif self.metrics.bar is not None:
                self.metrics.bar.update(1)
            if cfg.eval.eval_steps and self.step % cfg.eval.eval_steps == 0 and self.step < cfg.max_steps:
                self._eval()
            if cfg.save_steps and self.step % cfg.save_steps == 0:
                self._save()
        if stop.requested and self.step < cfg.max_steps:
            self._stop(stop)
        return self._finish(stop)

    def _finish(self, stop: Preemption) -> Path:
        """The end checkpoint (the complete trainer state, even with save_steps 0: a larger max_steps,
        or a resume after a callback's early stop, continues from it), the final evaluation, final/,
        the uploads; then the run is complete and a signal changes nothing. A signal in between lets
        this finish (bounded work; the end checkpoint makes a kill cost only the final evaluation)."""
        stop.saving = True
        if self.step != self.saved_step:
            self._save()
        self._eval()  # while the end checkpoint uploads; final/ must not supersede it in the mirror's queue
        final = self._write_final() if self._finish_uploads(self._upload_wait(stop)) else None
        if final is None or not self._finish_uploads(self._upload_wait(stop)):
            self.metrics.close("preempted")
            raise Preempted(f"preempted at step {self.step} while uploading to {self.cfg.checkpoint_uri}; "
                            "run again to finish")
        stop.complete()
        self.metrics.close()
        return final

    def _stop(self, stop: Preemption) -> None:
        """Save (unless the newest checkpoint already is this state), flush uploads, raise Preempted."""
        stop.saving = True
        if self.step != self.saved_step:
            folder = self._save()
            what = f"checkpoint {folder.name} saved"
        else:
            what = "nothing new since the last checkpoint" if self.step else "nothing trained yet"
        self._finish_uploads(self._upload_wait(stop))
        self.metrics.close("preempted")
        raise Preempted(f"preempted at step {self.step}; {what}; resume to continue")

    def _write_final(self) -> Path:
        final = self.out / "final"
        tmp = self.out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        save_pretrained(self.model, self.tokenizer, tmp, dtype=self.cfg.model.dtype)
        (tmp / CONFIG_FILE).write_text(checkpoint_config(self.cfg))  # with the manifest's step: "complete"
        ckpt.write_manifest(tmp, self.step)
        ckpt.fsync_tree(tmp)
        ckpt.publish(tmp, final)
        if self.mirror is not None:  # the remote also gets the final model, as URL/final
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
            self.mirror.upload(final, scratch_root=self.ckpt_root)
        return final

    @staticmethod
    def _upload_wait(stop: Preemption) -> float | None:
        """How long the uploads may still take: unbounded, or after a notice what the grace leaves."""
        return max(0.0, stop.remaining() - UPLOAD_MARGIN_S) if stop.requested else None

    def _finish_uploads(self, timeout: float | None) -> bool:
        """Wait for the uploads (at most `timeout` s); True when none is left."""
        if self.mirror is not None and not self.mirror.wait(timeout):
            log.warning("checkpoint upload to %s still running after %.0f s; stopping anyway (the remote "
                        "keeps its previous complete checkpoint)", self.cfg.checkpoint_uri, timeout or 0)
            return False
        return True


def load_weights(model, folder: Path) -> None:
    """Policy weights from a checkpoint: the LoRA adapter when there is one, else the full model."""
    from safetensors.torch import load_file

    if hasattr(model, "peft_config"):
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(model, load_file(str(folder / "adapter" / "adapter_model.safetensors")))
        return
    files = sorted(folder.glob("model*.safetensors"))
    if not files:
        raise UserError("checkpoint has no model weights", where=str(folder))
    state = {}
    for f in files:
        state.update(load_file(str(f)))
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or [])
    if unexpected or [k for k in missing if k not in tied and "lm_head" not in k]:
        raise UserError(f"checkpoint weights do not fit the model (missing {missing[:3]}, unexpected "
                        f"{unexpected[:3]})", where=str(folder))


def train(cfg: Config, *, callbacks=()) -> Path:
    """Set up and run under one signal handler: a signal during setup stops at once (exit 75,
    nothing to save); during training it stops at the next step boundary with a checkpoint; once
    the outputs are complete it changes nothing. In the `preftune` process the handler is the
    process's own (installed at its first line, kept to its exit); otherwise it is installed for
    this call and the handlers in place before are restored when it returns or raises. Until the
    first optimizer step, output_dir is guarded: an error leaves it as it was found
    (train/outdir.py). A run whose outputs are already complete returns its final/ untouched."""
    stop = process_handler()
    if stop is None:
        with Preemption(cfg.preemption_grace_seconds) as stop:
            return _train(cfg, stop, StartupClock(), callbacks)
    return _train(cfg, stop, StartupClock(process_start()), callbacks)


def _train(cfg: Config, stop: Preemption, clock: StartupClock, callbacks) -> Path:
    from preftune.train.completion import completed

    done = completed(cfg)
    if done is not None:
        log.info("already complete: %s; nothing to do", done)
        stop.complete()
        return Path(cfg.output_dir) / "final"
    import_model_libraries(cfg.model)  # start-up still: a signal here ends the process at once
    clock.mark("imports")
    stop.setup(cfg.preemption_grace_seconds)
    with OutputGuard(Path(cfg.output_dir)) as guard:
        run = Run(cfg, callbacks=callbacks, clock=clock)
        run.on_first_step = guard.commit
        return run.run(stop)
