"""Helpers for multi-process tests: start N ranks of `preftune train` on 127.0.0.1 with gloo (the
variables torchrun would set, so one rank can be signalled or killed by itself), a deterministic
fake sampler for "online GRPO fed identical rollouts", and result readers."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch
from tests.hf_folder import folder_state

ROOT = Path(__file__).resolve().parents[2]

# Runs `preftune` after optional test hooks: PREFTUNE_TEST_FAKE_SAMPLER=1 replaces the sampler by
# fake_sample (same completions for a prompt whatever the rank); PREFTUNE_TEST_STEP_PAUSE=S sleeps S
# seconds after each step's forward/backward, so a test can signal a rank mid-run;
# PREFTUNE_TEST_MARK_LOADS=1 prints a line for each read of a model's weights;
# PREFTUNE_TEST_MASKED=X sets logps.MASKED (0: packed rows, 1e9: plain rows).
DRIVER = """
import os, sys, time
if os.environ.get("PREFTUNE_TEST_DUMP_AFTER"):  # a hung rank prints its stacks and exits
    import faulthandler
    faulthandler.dump_traceback_later(float(os.environ["PREFTUNE_TEST_DUMP_AFTER"]), exit=True)
if os.environ.get("PREFTUNE_TEST_MARK_LOADS"):  # each read of a model's weights prints a line
    import transformers
    read = transformers.AutoModelForCausalLM.from_pretrained
    def marked(*a, **k):
        print("TEST weights read", flush=True)
        return read(*a, **k)
    transformers.AutoModelForCausalLM.from_pretrained = marked
    from preftune.model.llama import Llama
    own = Llama.from_pretrained.__func__
    def own_marked(cls, *a, **k):
        if k.get("weights", True):
            print("TEST weights read", flush=True)
        return own(cls, *a, **k)
    Llama.from_pretrained = classmethod(own_marked)
if os.environ.get("PREFTUNE_TEST_MASKED"):  # the packer's layout, as the 1-process reference has it
    from preftune.model import logps
    logps.MASKED = float(os.environ["PREFTUNE_TEST_MASKED"])
if os.environ.get("PREFTUNE_TEST_FAKE_SAMPLER"):
    from tests.distributed.ranks import install_fake_sampler
    install_fake_sampler()
if os.environ.get("PREFTUNE_TEST_FAKE_AGENT"):
    from tests.distributed.ranks import install_fake_agent
    install_fake_agent(os.environ["PREFTUNE_TEST_FAKE_AGENT"])
pause = float(os.environ.get("PREFTUNE_TEST_STEP_PAUSE", "0"))
if pause:
    from preftune.run import loop
    build = loop.build_task
    def slow(*a, **k):
        task = build(*a, **k)
        inner = task.step
        def step(model, n, stop):
            out = inner(model, n, stop)
            time.sleep(pause)
            return out
        task.step = step
        return task
    loop.build_task = slow
from preftune.cli.command import finish, main
finish(main(sys.argv[1:]))  # as `preftune` and `python -m preftune.cli` end: no interpreter teardown
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fake_sample(model, prompt_ids, prompt_mask, *, num_generations, max_new_tokens, eos_id, pad_id, **_):
    """Completions drawn from a generator seeded by the prompt's own tokens: the same rollout for a
    prompt on any rank and at any world size (the real sampler's stream depends on the batch)."""
    from preftune.rollout.sampler import Rollout

    rows, masks, cut = [], [], []
    for ids, m in zip(prompt_ids, prompt_mask):
        toks = ids[m.bool()].tolist()
        g = torch.Generator().manual_seed(hash(tuple(toks)) % (2 ** 31))
        for _ in range(num_generations):
            length = int(torch.randint(1, max_new_tokens + 1, (1,), generator=g))
            c = torch.randint(2, 200, (max_new_tokens,), generator=g)
            done = length < max_new_tokens or bool(torch.randint(0, 2, (1,), generator=g))
            if done:
                c[length - 1] = eos_id
            c[length:] = pad_id
            mask = torch.zeros(max_new_tokens, dtype=torch.long)
            mask[:length] = 1
            rows.append(c), masks.append(mask), cut.append(not done)
    G = num_generations
    return Rollout(prompt_ids=prompt_ids.repeat_interleave(G, 0), prompt_mask=prompt_mask.repeat_interleave(G, 0),
                   completion_ids=torch.stack(rows), completion_mask=torch.stack(masks),
                   truncated=torch.tensor(cut, dtype=torch.bool))


def install_fake_sampler() -> None:
    import preftune.rollout.engine as engine  # the own sampler behind the engine interface

    engine.sample = fake_sample


ADD_CALL = '<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": 2}}}}</tool_call>'


def install_fake_agent(later: str) -> None:
    """Every rollout's first turn is a call to `add` (a random-init model would not write one),
    later turns come from the own sampler (`later="real"`) or from fake_sample ("fake": the same
    tokens for a prompt on any rank, for comparing world sizes)."""
    import preftune.rollout.engine as engine
    from preftune.rollout.sampler import assemble

    real = engine.SamplerEngine.generate
    if later == "fake":
        engine.sample = fake_sample

    def forced(self, prompts, positions=None, *, turn=0, **kw):
        if turn > 0:
            return real(self, prompts, positions, turn=turn, **kw)
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(ROOT / "examples" / "agent_model")
        G = kw["num_generations"]  # a group's calls differ (a = 0..G-1), so do its later turns
        ids = [tok(ADD_CALL.format(a=g), add_special_tokens=False).input_ids + [kw["eos_id"]]
               for g in range(G)]
        ids = torch.tensor(ids * len(prompts))  # (N, L): the group's G calls, prompt after prompt
        return assemble(ids[:, :1], ids[:, :1], ids, kw["eos_id"])

    engine.SamplerEngine.generate = forced


def rank_env(rank: int, world: int, port: int, **extra) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONHASHSEED="0", RANK=str(rank),
               WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Ranks:
    """`world` processes of `preftune train CONFIG OVERRIDES`, each logging to its own file."""

    def __init__(self, tmp: Path, world: int, args: list[str], name: str = "ranks", **env):
        tmp.mkdir(parents=True, exist_ok=True)
        driver = tmp / "driver.py"
        driver.write_text(DRIVER)
        port = free_port()
        self.logs = [tmp / f"{name}-rank{r}.log" for r in range(world)]
        self.procs = []
        for r in range(world):
            with open(self.logs[r], "w") as f:
                self.procs.append(subprocess.Popen([sys.executable, str(driver), "train", *map(str, args)],
                                                   stdout=f, stderr=subprocess.STDOUT, cwd=tmp,
                                                   env=rank_env(r, world, port, **env)))

    def text(self, r: int = 0) -> str:
        return self.logs[r].read_text()

    def wait(self, timeout: float = 240) -> list[int]:
        end = time.monotonic() + timeout
        codes = []
        for r, p in enumerate(self.procs):
            try:
                codes.append(p.wait(max(1.0, end - time.monotonic())))
            except subprocess.TimeoutExpired:
                for q in self.procs:
                    q.kill()
                raise AssertionError(f"rank {r} timed out; log:\n{self.text(r)[-3000:]}") from None
        return codes

    def until(self, cond, what: str, timeout: float = 240) -> None:
        end = time.monotonic() + timeout
        while not cond():
            if time.monotonic() > end or any(p.poll() is not None for p in self.procs):
                for q in self.procs:
                    q.kill()
                raise AssertionError(f"never saw {what}; rank 0 log:\n{self.text(0)[-3000:]}")
            time.sleep(0.2)


# The largest weight difference allowed between 2 ranks and 1 process after a few float32 Adam
# steps: rounding in another summation order, which Adam amplifies on near-zero gradients
# (docs/ARCHITECTURE.md). Under 1e-5 on the earlier VM; 1.05-1.10e-5 in four tests on the
# 2026-12-03 VM (float32 matmul peak 386 GFLOP/s against 323), where the code at 7cefb52 gives the
# same. The float64 layout test (test_layouts.py) holds the exact equality.
WEIGHT_TOL = 3e-5


def metric_rows(out: Path) -> list[dict]:
    return [r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def final_state(out: Path) -> dict[str, torch.Tensor]:
    return folder_state(out / "final")
