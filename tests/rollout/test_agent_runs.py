"""Tool runs under real processes: SIGTERM and SIGKILL in the middle of a multi-turn rollout, then a
rerun, give the uninterrupted run's weights bit for bit; 2 ranks with tools train like 1 process.

The first turn of every rollout is a forced call to `add` (tests/distributed/ranks.py's fake
agent); the tool itself sends the signal on its K-th call, so the run is inside a rollout when it
arrives."""
from __future__ import annotations

import json
import signal

import pytest

from preftune.errors import EXIT_OK, EXIT_PREEMPTED
from tests.conftest import EXAMPLES
from tests.distributed.ranks import Ranks
from tests.distributed.test_distributed import assert_same_training
from tests.run.test_resume import assert_same_run, write_config

STEPS = 4
TOOLS = '''
import os
import signal

calls = 0


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: first addend
        b: second addend
    """
    global calls
    calls += 1
    if calls == int(os.environ.get("TEST_SIGNAL_AT_CALL", "0")):
        os.kill(os.getpid(), getattr(signal, os.environ["TEST_SIGNAL"]))
    return a + b
'''


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("agent-files")
    (d / "tools.py").write_text(TOOLS)
    rows = [{"input": [{"role": "user", "content": f"{i}+{i + 1}="}]} for i in range(16)]
    (d / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return d


def args(files, out, **extra) -> list:
    o = {"output_dir": out, "model.name_or_path": EXAMPLES / "agent_model", "seed": 0,
         "max_steps": STEPS, "save_steps": 2, "log.progress_bar": "false",
         "data.train": files / "prompts.jsonl", "data.eval": "null", "data.max_prompt_length": 64,
         "grpo.tools": f"[{files / 'tools.py'}:add]", "grpo.reward_funcs": "[length]",
         "grpo.prompts_per_step": 2, "grpo.num_generations": 2, "grpo.micro_batch_size": 8,
         "grpo.max_completion_length": 110, "grpo.loss_type": "bnpo", "optim.lr": 1e-3,
         "optim.lr_scheduler": "constant"} | extra
    return [write_config(out.parent / "run.yaml"), *(f"{k}={v}" for k, v in o.items())]


def run(tmp, files, out, world=1, later="real", name="run", **env) -> Ranks:
    return Ranks(tmp, world, args(files, out), name=name, PREFTUNE_TEST_FAKE_AGENT=later, **env)


@pytest.fixture(scope="module")
def reference(files, tmp_path_factory):
    done = {}

    def get(later: str):
        if later not in done:
            tmp = tmp_path_factory.mktemp(f"agent-ref-{later}")
            ranks = run(tmp, files, tmp / "run", later=later)
            assert ranks.wait() == [EXIT_OK], ranks.text(0)[-3000:]
            done[later] = tmp / "run"
        return done[later]

    return get


@pytest.mark.parametrize("sig, code", [("SIGTERM", EXIT_PREEMPTED), ("SIGKILL", -signal.SIGKILL)])
def test_a_signal_mid_rollout_then_a_rerun_equals_the_uninterrupted_run(sig, code, files, reference,
                                                                        tmp_path):
    out = tmp_path / "run"
    # 4 rollouts of one call each per step: call 10 is inside step 3's rollout
    first = run(tmp_path, files, out, name="first", TEST_SIGNAL=sig, TEST_SIGNAL_AT_CALL=10)
    assert first.wait() == [code], first.text(0)[-3000:]
    assert (out / "checkpoints" / "step-2").is_dir() and not (out / "final").exists()
    again = run(tmp_path, files, out, name="again")
    assert again.wait() == [EXIT_OK], again.text(0)[-3000:]
    assert "resumed from" in again.text(0)
    assert_same_run(reference("real"), out)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["tools/call_frequency"] == 1.0 for r in rows if "loss" in r)


def test_two_ranks_with_tools_train_like_one_process(files, reference, tmp_path):
    out = tmp_path / "run"
    ranks = run(tmp_path, files, out, world=2, later="fake")
    assert ranks.wait() == [EXIT_OK, EXIT_OK], ranks.text(0)[-3000:] + ranks.text(1)[-3000:]
    assert_same_training(reference("fake"), out)
