"""The run: set up, resume, step, log, evaluate, checkpoint, and stop cleanly on preemption.

The loop owns the optimizer, the schedule, logging, checkpoints and the stop flag; a *task*
(`GRPOTask`, `DPOTask`) owns its data order and does one step's forward/backward.
"""
from __future__ import annotations

import logging
import random
import shutil
import time
from pathlib import Path

import numpy as np
import torch

from preftune.config import Config, to_yaml
from preftune.errors import Preempted, UserError
from preftune.models import load_model, load_tokenizer, resolve_model_path, save_pretrained
from preftune.train import checkpoint as ckpt
from preftune.train.evaluate import build_evaluator
from preftune.train.metrics import MetricsLog
from preftune.train.optim import build_optimizer, clip_and_step, lr_at, set_lr
from preftune.train.preemption import Preemption, StepAbandoned
from preftune.train.resume import check_compatible, find_resume_point

log = logging.getLogger("preftune")


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    np_state = np.random.get_state()
    state = {"python": list(random.getstate()[1]), "python_pos": random.getstate()[2],
             "numpy": torch.from_numpy(np_state[1].astype(np.int64)), "numpy_pos": int(np_state[2]),
             "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate((3, tuple(state["python"]), state["python_pos"]))
    np.random.set_state(("MT19937", state["numpy"].numpy().astype(np.uint32), state["numpy_pos"], 0, 0.0))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def build_task(cfg: Config, model, tokenizer, device):
    if cfg.algorithm == "grpo":
        from preftune.train.grpo_task import GRPOTask

        return GRPOTask(cfg, model, tokenizer, device)
    from preftune.train.dpo import DPOTask

    return DPOTask(cfg, model, tokenizer, device)


class Run:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.out = Path(cfg.output_dir)
        self.ckpt_root = self.out / "checkpoints"
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.mirror = ckpt.RemoteMirror(cfg.checkpoint_uri) if cfg.checkpoint_uri else None
        resume_from = find_resume_point(cfg, self.out, self.ckpt_root, self.mirror)
        self.out.mkdir(parents=True, exist_ok=True)
        ckpt.clean_stale(self.ckpt_root)
        seed_everything(cfg.seed)
        base_path = resolve_model_path(cfg.model, cfg.config_dir)
        self.tokenizer = load_tokenizer(base_path, cfg.model.trust_remote_code)
        self.model = load_model(cfg.model, base_path).to(self.device)
        self.task = build_task(cfg, self.model, self.tokenizer, self.device)
        self.evaluator = build_evaluator(cfg, self.tokenizer)
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad], cfg.optim)
        self.step = 0
        if resume_from is not None:
            self._restore(resume_from)
        (self.out / "config.yaml").write_text(to_yaml(cfg))
        # a fresh start drops every old record; a resume keeps those up to its checkpoint
        self.metrics = MetricsLog(self.out, total_steps=cfg.max_steps, start_step=self.step if self.step else -1,
                                  progress=cfg.log.progress_bar, tensorboard="tensorboard" in cfg.log.report_to)

    def _restore(self, folder: Path) -> None:
        state = ckpt.load_state(folder)
        check_compatible(state["config"], self.cfg, folder)
        load_weights(self.model, folder)
        self.optimizer.load_state_dict(state["optimizer"])
        self.task.load_state_dict(state["task"])
        set_rng_state(state["rng"])
        self.step = int(state["step"])
        log.info("resumed from %s (step %d)", folder, self.step)

    def _save(self) -> Path:
        def write(tmp: Path) -> None:
            save_pretrained(self.model, self.tokenizer, tmp)
            if hasattr(self.model, "peft_config"):
                self.model.save_pretrained(str(tmp / "adapter"))
            ckpt.save_state(tmp, {"step": self.step, "optimizer": self.optimizer.state_dict(),
                                  "task": self.task.state_dict(), "rng": rng_state(),
                                  "config": ckpt_config(self.cfg)})

        folder = ckpt.save(self.ckpt_root, self.step, write, keep=self.cfg.save_total_limit)
        if self.mirror is not None:
            self.mirror.upload(folder)
        return folder

    def _eval(self) -> None:
        if self.evaluator is not None:
            self.metrics.log(self.step, self.evaluator(self.model, self.step))

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

    def run(self) -> Path:
        cfg = self.cfg
        if self.step == 0:
            self._eval()
        with Preemption(cfg.preemption_grace_seconds) as stop:
            while self.step < cfg.max_steps and not stop.requested:
                snapshot = self.task.state_dict()
                try:
                    m = self._one_step(stop)
                except StepAbandoned:  # grace nearly spent: roll the data position back to the last step
                    self.step -= 1
                    self.optimizer.zero_grad(set_to_none=True)
                    self.task.load_state_dict(snapshot)
                    break
                if self.step % cfg.log.logging_steps == 0 or self.step == cfg.max_steps:
                    self.metrics.log(self.step, m, advance=True)
                elif self.metrics.bar is not None:
                    self.metrics.bar.update(1)
                if cfg.eval.eval_steps and self.step % cfg.eval.eval_steps == 0 and self.step < cfg.max_steps:
                    self._eval()
                if cfg.save_steps and self.step % cfg.save_steps == 0:
                    self._save()
            if stop.requested and self.step < cfg.max_steps:
                stop.saving = True
                self._save()
                self._finish_uploads()
                self.metrics.close()
                raise Preempted(f"preempted at step {self.step}; checkpoint saved, resume to continue")
        self._eval()
        final = self.out / "final"
        tmp = self.out / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        save_pretrained(self.model, self.tokenizer, tmp)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        self._finish_uploads()
        self.metrics.close()
        return final

    def _finish_uploads(self) -> None:
        if self.mirror is not None:
            self.mirror.wait()


def ckpt_config(cfg: Config) -> str:
    return to_yaml(cfg)


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


def train(cfg: Config) -> Path:
    return Run(cfg).run()
