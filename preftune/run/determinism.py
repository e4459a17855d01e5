"""Bitwise-reproducible kernels when a run asks for them (`full_determinism`, the Hugging Face
TrainingArguments name). CPU runs of one config and world size are reproducible without it (the
busy-machine tests in tests/run/test_busy_machine.py); on CUDA several fast kernels accumulate with
atomics or pick algorithms by timing, so exactness costs speed there (bench/gpu.sh measures it)."""
from __future__ import annotations

import logging
import os

import torch

log = logging.getLogger("preftune")
CUBLAS_WORKSPACE = ":4096:8"  # cuBLAS's documented setting for deterministic results with streams


def enable_full_determinism(device: torch.device) -> None:
    """Deterministic algorithms (a warning, not an error, where an op has none), cuDNN without
    autotuning, TF32 off, and on CUDA the memory-efficient SDPA kernel off (its backward
    accumulates with atomics; flash and math have deterministic backwards under this flag)."""
    # read when cuBLAS makes its first handle: set before the model's first matmul on the GPU
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = True, False
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    if device.type == "cuda":
        torch.backends.cuda.enable_mem_efficient_sdp(False)
    log.info("full_determinism: deterministic algorithms on, TF32 off%s",
             ", memory-efficient SDPA off" if device.type == "cuda" else "")
