"""Host memory: glibc's malloc keeps freed activations for the next step (fewer page faults), unless
the user tuned malloc or preloaded another allocator."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from preftune.distributed.group import Parallel
from preftune.run import host_memory

# Training-like steps: forward and backward of a small MLP over micro-batches of three sizes, 14
# times; the page faults of the last ten, in a fresh process with or without keep_freed_memory().
CHILD = """
import json, resource, sys, torch
from preftune.run.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "keep" else False
torch.manual_seed(0)
layers = [torch.nn.Linear(256, 768), torch.nn.Linear(768, 256)] * 2
faults = []
for step in range(14):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for rows in (1024, 3000, 2048):
        x = torch.randn(rows, 256)
        for i in range(0, len(layers), 2):
            x = x + layers[i + 1](torch.nn.functional.silu(layers[i](x)))
        x.square().mean().backward()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"applied": applied, "faults": sum(faults[4:])}))
"""


def _child(mode: str, **env) -> dict:
    clean = {k: v for k, v in os.environ.items() if not host_memory.user_chose({k: v})}
    out = subprocess.run([sys.executable, "-c", CHILD, mode], env=clean | env, capture_output=True, text=True,
                         check=True, timeout=120)
    return json.loads(out.stdout.splitlines()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_freed_memory_is_reused_instead_of_faulted_in_again():
    default, kept = _child("default"), _child("keep")
    assert kept["applied"] and not default["applied"]
    # by default, freed activations go back to the kernel and come back as fresh pages (measured: 2,000-
    # 18,000 faults per step); kept, the steps run on memory they already touched (0, or ~1,300-3,000 in
    # a step where the heap grew once more)
    assert default["faults"] > 10_000
    assert kept["faults"] < default["faults"] / 4
    # the user's own malloc settings win: nothing applied, the default behaviour
    assert not _child("keep", MALLOC_ARENA_MAX="2")["applied"]


def test_user_choices_are_left_alone():
    assert not host_memory.user_chose({"PATH": "/bin", "LD_PRELOAD": ""})
    assert host_memory.user_chose({"MALLOC_TRIM_THRESHOLD_": "0"})
    assert host_memory.user_chose({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=0"})
    assert host_memory.user_chose({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"})
    assert not host_memory.user_chose({"LD_PRELOAD": "/opt/libfoo.so"})


def test_a_cpu_run_keeps_freed_memory(make_config, monkeypatch):
    from preftune.run import loop

    calls = []
    monkeypatch.setattr(loop, "keep_freed_memory", lambda: calls.append(1))
    loop.Run(make_config(), dp=Parallel())
    assert calls == [1]
