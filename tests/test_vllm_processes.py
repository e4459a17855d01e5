"""The vLLM test modules (tests/conftest.VLLM_MODULES), each in a pytest process of its own: one
engine per module, and no engine in the process that runs the other modules."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import OWN_PROCESS, ROOT, VLLM_MODULES, require_vllm


@pytest.mark.parametrize("module", VLLM_MODULES)
def test_vllm_module(module):
    require_vllm()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:warnings", "-p", "no:cacheprovider",
                           f"tests/{module}"], cwd=ROOT, capture_output=True, text=True, timeout=1500,
                          env=dict(os.environ, **{OWN_PROCESS: "1"}))
    summary = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert done.returncode == 0, "\n".join(summary) + "\n" + done.stdout[-4000:]
    assert " passed" in done.stdout.splitlines()[-1] and "skipped" not in done.stdout.splitlines()[-1]
