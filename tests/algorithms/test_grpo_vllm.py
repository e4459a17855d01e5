"""Online GRPO sampled by vLLM (grpo.use_vllm): the in-process runs share one engine (the task's
`start_engine` patched to return it; weights are pushed before every generation batch, so a run
never sees another's); 2 torchrun ranks start an engine each.

- the metrics show the weights reach the engine (the trainer's and the engine's log-probs agree
  after updates), and the importance correction is TRL's;
- an interrupted run (SIGTERM while the engine samples) resumes to the uninterrupted run's final
  weights, bitwise;
- 2 ranks with FSDP2 train like 1 process;
- the demo learns.
"""
from __future__ import annotations

import os
import signal

import pytest
import torch

from preftune.algorithms import grpo
from preftune.config import load_config
from preftune.errors import EXIT_OK
from preftune.run import loop
from preftune.run.metrics import read_records
from tests.conftest import EXAMPLES
from tests.distributed.ranks import WEIGHT_TOL, Ranks, final_state, metric_rows
from tests.run.test_resume import (  # noqa: F401 - fixtures used by name
    assert_same_run, data_dir, one_thread, overrides, write_config,
)

STEPS = 4
VLLM = {"grpo.use_vllm": "true", "grpo.vllm_kv_cache_gib": 1, "max_steps": STEPS, "save_steps": 2,
        "grpo.temperature": 1.0, "grpo.top_k": 20, "grpo.top_p": 0.95, "grpo.reward_funcs": "[accuracy]", "grpo.prompts_per_step": 4,
        "grpo.scale_rewards": "batch", "optim.lr": 1e-4, "optim.lr_scheduler": "constant"}


@pytest.fixture
def shared(vllm_engine, monkeypatch):
    monkeypatch.setattr(grpo, "start_engine", lambda cfg, dp=None: vllm_engine)
    return vllm_engine


@pytest.fixture(scope="module")
def reference(vllm_engine, data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("vllm-ref") / "run"
    with pytest.MonkeyPatch.context() as m:
        m.setattr(grpo, "start_engine", lambda cfg, dp=None: vllm_engine)
        loop.train(load_config(None, overrides("online", out, data_dir, **VLLM)))
    return out


def test_weights_reach_the_engine_after_every_update(reference):
    rows = metric_rows(reference)
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    for r in rows:  # the trainer's log-probs at the weights that sampled are the engine's
        assert r["sampling/sampling_logp_difference/max"] < 1e-3, r
        assert r["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-3)
        assert r["vllm/weight_push_s"] > 0
    assert all(r["grad_norm"] > 0 for r in rows)  # every step moved the policy the engine then sampled


def test_sigterm_while_the_engine_samples_resumes_exactly(shared, reference, data_dir, tmp_path, monkeypatch):
    from preftune.errors import Preempted

    out = tmp_path / "run"
    ovr = overrides("online", out, data_dir, **VLLM)
    generate = shared.generate
    calls = []

    def interrupted(*a, **k):  # SIGTERM arrives while step 3's batch is sampled
        calls.append(k.get("step"))
        if k.get("step") == 3 and calls.count(3) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return generate(*a, **k)

    with monkeypatch.context() as m:
        m.setattr(shared, "generate", interrupted)
        with pytest.raises(Preempted):
            loop.train(load_config(None, ovr))
    assert (out / "checkpoints" / "step-2").is_dir() and not (out / "final").exists()
    loop.train(load_config(None, ovr))
    assert_same_run(reference, out)


def test_two_ranks_with_vllm_train_like_one_process(reference, data_dir, tmp_path):
    out = tmp_path / "run"
    args = overrides("online", out, data_dir, **(VLLM | {"distributed.strategy": "fsdp", "save_steps": 0}))
    ranks = Ranks(tmp_path, 2, [write_config(tmp_path / "run.yaml"), *args])
    codes = ranks.wait(timeout=400)
    assert codes == [EXIT_OK, EXIT_OK], ranks.text(0)[-3000:] + ranks.text(1)[-3000:]
    one, two = metric_rows(reference), metric_rows(out)
    for a, b in zip(one, two):  # the same tokens sampled: same rewards, same losses
        assert b["reward"] == a["reward"] and b["completions/mean_length"] == a["completions/mean_length"], a["step"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-6), a["step"]
        assert b["sampling/sampling_logp_difference/max"] < 1e-3  # each rank's engine got the new weights
    wa, wb = final_state(reference), final_state(out)
    worst = max(wa, key=lambda k: (wa[k] - wb[k]).abs().max().item())
    assert (wa[worst] - wb[worst]).abs().max().item() < WEIGHT_TOL, worst


def test_the_demo_learns_with_vllm(shared, tmp_path):
    out = tmp_path / "demo"
    cfg = load_config(str(EXAMPLES / "grpo.yaml"), [f"output_dir={out}", "grpo.use_vllm=true", "save_steps=0",
                                                     "eval.eval_steps=100", "log.progress_bar=false"])
    torch.set_num_threads(2)
    loop.train(cfg)
    evals = [r["eval/reward"] for r in read_records(out / "metrics.jsonl") if "eval/reward" in r]
    assert len(evals) == 3 and evals[-1] > evals[0] + 0.25, evals  # 0.33 -> 0.73 with the own sampler


def test_two_ranks_share_one_tensor_parallel_engine(reference, data_dir, tmp_path):
    """grpo.vllm_tensor_parallel_size=2 on 2 ranks: one engine over both, each rank's prompts sent
    by both, each rank keeping its own rows; the weights reach the sharded engine, and the held-out
    evaluation samples through it too."""
    from tests.run.test_resume import small_eval

    out = tmp_path / "run"
    extra = {"distributed.strategy": "fsdp", "save_steps": 0, "grpo.vllm_tensor_parallel_size": 2,
             "data.eval": small_eval(data_dir), "eval.eval_steps": 2}
    ranks = Ranks(tmp_path, 2, [write_config(tmp_path / "run.yaml"), *overrides("online", out, data_dir, **(VLLM | extra))])
    codes = ranks.wait(timeout=400)
    assert codes == [EXIT_OK, EXIT_OK], ranks.text(0)[-3000:] + ranks.text(1)[-3000:]
    one, two = metric_rows(reference), metric_rows(out)
    assert [r["step"] for r in two] == list(range(1, STEPS + 1))
    for a, b in zip(one, two):
        assert b["sampling/sampling_logp_difference/max"] < 1e-3, b  # the sharded engine got the new weights
        assert b["reward"] == a["reward"] and b["grad_norm"] > 0  # measured: the same tokens as 1 process
    evals = [r for r in read_records(out / "metrics.jsonl") if "eval/reward" in r]
    assert [r["step"] for r in evals] == [0, 2, 4] and all(r["eval/num_prompts"] == 6 for r in evals)
