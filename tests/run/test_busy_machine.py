"""Same seed, same weights on a busy machine (issue 35).

The other exactness tests run with one intra-op thread, where nothing can race. These run with four
threads on this 2-core machine beside a neighbour that keeps both cores busy, as training runs on a shared node: the
same config run twice, SIGTERM + resume and SIGKILL + resume must all end with bitwise-equal
weights and equal metrics. The batches are large enough (256+ predicted tokens) for torch's CPU
kernels to take their multi-threaded paths.

The cause they caught: a trunk's last token predicts the first token of each of its branches, so
the training pass gathers repeated positions; the backward of `h[index]` on CPU adds the repeats
with racing atomics, whose order depended on thread timing (`Llama.forward` uses index_select).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig

from preftune.config import load_config
from preftune.model import logps as lp
from preftune.model.llama import Llama
from preftune.run import loop
from tests.run.test_resume import (  # noqa: F401 - fixtures used by name
    assert_same_run, data_dir, overrides, saved_steps, train_until_preempted, write_config,
)

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "examples" / "model"
BUSY_SECONDS = 240  # a bound on each neighbour, in case a test dies without stopping it
# big enough that the gather backward of the shared-prompt layout runs threaded (K x H >= 32768)
ONLINE = {"grpo.prompts_per_step": 16, "grpo.num_generations": 8, "max_steps": 3, "save_steps": 0}
DPO = {"dpo.batch_size": 32, "dpo.micro_batch_size": 32, "max_steps": 3, "save_steps": 0}
KTO = {"kto.batch_size": 32, "kto.micro_batch_size": 32, "max_steps": 3, "save_steps": 0}
SFT = {"sft.batch_size": 32, "sft.micro_batch_size": 32, "max_steps": 3, "save_steps": 2}


@pytest.fixture
def neighbour():
    """Two busy processes beside the test: both cores contended while it runs."""
    code = f"import time\nend = time.monotonic() + {BUSY_SECONDS}\nwhile time.monotonic() < end:\n    pass\n"
    procs = [subprocess.Popen([sys.executable, "-c", code]) for _ in range(2)]
    yield
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture
def four_threads():
    """More threads than cores, as a container that sees the host's cores gets: a thread is often
    descheduled mid-kernel, which is what reorders a racing accumulation."""
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    yield
    torch.set_num_threads(before)


def _grpo_batch(groups: int = 13, per_group: int = 12, T: int = 5, seed: int = 0):
    """A GRPO-shaped batch: `groups` prompts of 5-12 tokens, each with `per_group` completions of
    2-5 tokens. Odd sizes on purpose: the racing backward split the gathered positions between two
    threads, and only a group whose repeats fell on both sides of the split was added in a racing order."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, 250, (int(torch.randint(5, 13, (1,), generator=g)),), generator=g)
               for _ in range(groups)]
    P = max(len(p) for p in prompts)
    prompt_ids = torch.zeros(groups * per_group, P, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, p in enumerate(prompts):
        prompt_ids[i * per_group:(i + 1) * per_group, P - len(p):] = p  # left-padded
        prompt_mask[i * per_group:(i + 1) * per_group, P - len(p):] = 1
    completion_ids = torch.randint(3, 250, (groups * per_group, T), generator=g)  # (B, T)
    lengths = torch.randint(2, T + 1, (groups * per_group, 1), generator=g)  # (B, 1)
    completion_mask = (torch.arange(T)[None] < lengths).long()  # (B, T)
    return prompt_ids, prompt_mask, completion_ids * completion_mask, completion_mask


def test_training_pass_gradients_are_bitwise_stable_beside_a_neighbour(neighbour, four_threads):
    torch.manual_seed(0)
    model = Llama(AutoConfig.from_pretrained(MODEL)).train()
    batch = _grpo_batch()
    rows = lp.Rows.read(*batch[:2], batch[3])
    plan = lp._plan(rows, batch[0].size(1), batch[2].size(1), model.config, pack=True)
    assert len(set(plan.src)) < len(plan.src), "the layout must repeat positions (shared prompts)"
    weights = torch.randn(batch[2].shape, generator=torch.Generator().manual_seed(1))  # (B, T)

    def grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        out, _ = lp.completion_logps(model, *batch, rows=rows)  # (B, T)
        (out * weights).sum().backward()
        return [p.grad.clone() for p in model.parameters()]

    first = grads()
    for attempt in range(30):
        again = grads()
        differ = [i for i, (a, b) in enumerate(zip(first, again)) if not torch.equal(a, b)]
        assert not differ, f"pass {attempt + 2}: gradients of {len(differ)} parameters differ bitwise"


@pytest.mark.parametrize("kind, extra", [("online", ONLINE), ("dpo", DPO), ("kto", KTO), ("sft", SFT)])
def test_same_config_twice_gives_the_same_weights(kind, extra, neighbour, four_threads, data_dir, tmp_path):
    for name in ("a", "b"):
        loop.train(load_config(None, overrides(kind, tmp_path / name, data_dir, **extra)))
    assert_same_run(tmp_path / "a", tmp_path / "b")


def test_sigterm_and_resume_beside_a_neighbour(neighbour, four_threads, data_dir, tmp_path, monkeypatch):
    extra = ONLINE | {"max_steps": 4, "save_steps": 2}
    loop.train(load_config(None, overrides("online", tmp_path / "ref", data_dir, **extra)))
    ovr = overrides("online", tmp_path / "run", data_dir, **extra)
    assert "preempted at step 2;" in train_until_preempted(ovr, monkeypatch, 2, "after")
    loop.train(load_config(None, ovr))
    assert_same_run(tmp_path / "ref", tmp_path / "run")


def _train_process(tmp: Path, out: Path, data: Path, extra: dict) -> subprocess.Popen:
    cfg = write_config(tmp / "run.yaml")
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="4")
    cmd = [sys.executable, "-m", "preftune.cli", "train", str(cfg), *overrides("online", out, data, **extra)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=tmp)


def test_sigkill_and_resume_beside_a_neighbour(neighbour, data_dir, tmp_path):
    extra = ONLINE | {"max_steps": 4, "save_steps": 1}
    ref = _train_process(tmp_path, tmp_path / "ref", data_dir, extra)
    assert ref.wait(300) == 0
    run = _train_process(tmp_path, tmp_path / "run", data_dir, extra)
    end = time.monotonic() + 300
    while not saved_steps(tmp_path / "run") and time.monotonic() < end and run.poll() is None:
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.wait(60)
    assert run.returncode == -signal.SIGKILL and saved_steps(tmp_path / "run"), "killed after the first save"
    resumed = _train_process(tmp_path, tmp_path / "run", data_dir, extra)
    assert resumed.wait(300) == 0
    assert_same_run(tmp_path / "ref", tmp_path / "run")


def test_full_determinism_sets_the_deterministic_kernels_and_trains(data_dir, tmp_path):
    tf32 = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        loop.train(load_config(None, overrides("online", tmp_path / "run", data_dir, full_determinism="true",
                                               max_steps=2, save_steps=0)))
        assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
        assert not torch.backends.cuda.matmul.allow_tf32 and os.environ["CUBLAS_WORKSPACE_CONFIG"]
        assert (tmp_path / "run" / "final" / "model.safetensors").exists()
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.matmul.allow_tf32 = tf32


def test_two_ranks_twice_give_the_same_weights(neighbour, data_dir, tmp_path):
    """2 torchrun ranks (FSDP2, gloo), two threads each beside the neighbour: four busy processes
    on two cores. The same config twice gives bitwise-equal weights and metrics."""
    from tests.distributed.ranks import Ranks

    for name in ("a", "b"):
        ranks = Ranks(tmp_path / f"ranks-{name}", 2,
                      [write_config(tmp_path / "run.yaml"),
                       *overrides("online", tmp_path / name, data_dir, **ONLINE)],
                      OMP_NUM_THREADS=2)
        assert ranks.wait() == [0, 0], ranks.text(0)[-3000:] + ranks.text(1)[-3000:]
    assert_same_run(tmp_path / "a", tmp_path / "b")
