"""AdamW and the learning-rate schedule (a pure function of the step: nothing to checkpoint but the
step)."""
from __future__ import annotations

import math

import torch

from preftune.config import OptimConfig


def build_optimizer(params, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW, fused (one kernel for all tensors) where torch supports it: the per-tensor loop costs
    more than a small model's whole DPO step on CPU. TRL's trainer uses the fused kernel too."""
    params = list(params)
    fused = bool(params) and all(p.dtype in (torch.float32, torch.bfloat16, torch.float16)
                                 and p.device.type in ("cpu", "cuda") for p in params)
    return torch.optim.AdamW(params, lr=cfg.lr,
                             betas=(cfg.adam_beta1, cfg.adam_beta2), eps=cfg.adam_epsilon,
                             weight_decay=cfg.weight_decay, fused=fused or None)


def lr_at(step: int, max_steps: int, cfg: OptimConfig) -> float:
    """LR for optimiser step `step` (1-based): linear warmup from 0, then constant, linear or cosine
    to 0 (the Hugging Face schedules' shapes, so TRL users' warmup_ratio / lr_scheduler_type carry
    over)."""
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * max_steps)
    s = step - 1  # HF schedules evaluate at the number of steps already taken
    if warmup and s < warmup:
        return cfg.lr * s / warmup
    if cfg.lr_scheduler == "constant":
        return cfg.lr
    progress = (s - warmup) / max(1, max_steps - warmup)
    if cfg.lr_scheduler == "linear":
        return cfg.lr * max(0.0, 1.0 - progress)
    return cfg.lr * 0.5 * (1.0 + math.cos(math.pi * min(progress, 1.0)))


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def step(optimizer: torch.optim.Optimizer) -> None:
    """One optimiser step on the (clipped) gradients, which are then dropped."""
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
