"""Sharded checkpoints (FSDP2, torch.distributed.checkpoint) with 2 CPU ranks: the folder layout and
manifest; SIGTERM to one rank stops both at the same step with one checkpoint (exit 75) and the resumed
run ends bitwise equal to the uninterrupted one; a SIGKILLed rank makes the other exit non-zero within
the collective timeout, and the relaunch resumes exactly; a world-size change (2 -> 1, 1 -> 2) loads
the saved weights and optimizer state and trains on as the original run; `preftune export`; CPU
offload (distributed.cpu_offload) trains bitwise as without it, resumes exactly, and may be switched
off on a resume."""
from __future__ import annotations

import os
import shutil
import signal

import pytest
import torch

from preftune.cli.command import main
from preftune.config import load_config
from preftune.errors import EXIT_OK, EXIT_PREEMPTED
from preftune.run import checkpoint_folders as ckpt, loop
from tests.distributed.ranks import WEIGHT_TOL, Ranks, final_state, metric_rows
from tests.hf_folder import folder_state
from tests.run.test_resume import data_dir, one_thread, overrides, saved_steps, write_config  # noqa: F401

STEPS = 4


def args(out, data_dir, **extra) -> list[str]:
    o = {"max_steps": STEPS, "save_steps": 2, "optim.lr": 1e-3, "grpo.prompts_per_step": 4,
         "grpo.micro_batch_size": 3, "distributed.timeout_seconds": 20, **extra}
    return overrides("offline", out, data_dir, **o)


def launch(tmp, out, data_dir, name: str, extra: dict | None = None, **env) -> Ranks:
    env.setdefault("PREFTUNE_TEST_MASKED", "1e9")  # plain rows, as `train_one_process` runs them
    return Ranks(tmp, 2, [write_config(tmp / "run.yaml"), *args(out, data_dir, **(extra or {}))],
                 name=name, **env)


@pytest.fixture(scope="module")
def two_rank_run(data_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two")
    ranks = launch(tmp, tmp / "run", data_dir, "reference")
    assert ranks.wait() == [EXIT_OK, EXIT_OK], ranks.text(0)[-3000:]
    return tmp / "run"


def train_one_process(ovr: list[str]) -> None:
    """In this process, with the ranks' layout (plain rows: the comparisons measure the world size,
    not two layouts' rounding, which Adam amplifies on near-zero gradients)."""
    import preftune.model.logps as logps

    with pytest.MonkeyPatch.context() as m:
        m.setattr(logps, "MASKED", 1e9)
        loop.train(load_config(None, ovr))


@pytest.fixture(scope="module")
def one_rank_run(data_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("one") / "run"
    train_one_process(args(out, data_dir))
    return out


def assert_bitwise(a, b) -> None:
    wa, wb = final_state(a), final_state(b)
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)


def assert_continues_like(reference, resumed, first_step: int) -> None:
    """Steps after the resume match the reference run's (1e-4) and the final weights (WEIGHT_TOL)."""
    ra = {r["step"]: r for r in metric_rows(reference)}
    for r in metric_rows(resumed):
        if r["step"] >= first_step:
            for key in ("loss", "grad_norm"):
                assert r[key] == pytest.approx(ra[r["step"]][key], rel=1e-4), (r["step"], key)
    wa, wb = final_state(reference), final_state(resumed)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHT_TOL


def test_sharded_checkpoint_layout(two_rank_run):
    folder = two_rank_run / "checkpoints" / "step-2"
    assert saved_steps(two_rank_run) == [4, 2] and ckpt.verify(folder) is None
    names = set(ckpt.read_manifest((folder / ckpt.MANIFEST).read_text())["files"])
    assert {"shards/rank-0.json", "shards/rank-0.safetensors", "shards/rank-1.json", "shards/rank-1.safetensors",
            "trainer_state.json", "trainer_state.safetensors", "rank-1.json", "rank-1.safetensors",
            "preftune.yaml", "metrics.jsonl", "config.json"} <= names
    assert not any(n.startswith("model") for n in names)  # no consolidated copy per save
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(str(two_rank_run / "final"))  # final/ is one HF model


def test_sigterm_to_one_rank_stops_both_and_resume_is_exact(two_rank_run, data_dir, tmp_path):
    out = tmp_path / "run"
    ranks = launch(tmp_path, out, data_dir, "first", PREFTUNE_TEST_STEP_PAUSE="1")
    ranks.until(lambda: (out / "checkpoints" / "step-2").is_dir(), "the step-2 checkpoint")
    os.kill(ranks.procs[1].pid, signal.SIGTERM)  # a spot notice reaches only one node
    assert ranks.wait() == [EXIT_PREEMPTED, EXIT_PREEMPTED], ranks.text(0)[-2000:]
    # the notice stops both ranks at the next step boundary: step 3 normally, step 2 when it lands
    # before step 3 starts (a busy machine), whose checkpoint is then the one already written
    saved = saved_steps(out)
    assert saved in ([3, 2], [2]) and (saved == [2] or "checkpoint step-3 saved" in ranks.text(0))
    again = launch(tmp_path, out, data_dir, "second")
    assert again.wait() == [EXIT_OK, EXIT_OK], again.text(0)[-3000:]
    assert "resumed from" in again.text(0) and "resumed from" in again.text(1)
    assert_bitwise(two_rank_run, out)


def test_a_killed_rank_fails_the_other_and_the_relaunch_resumes_exactly(two_rank_run, data_dir, tmp_path):
    out = tmp_path / "run"
    ranks = launch(tmp_path, out, data_dir, "first", PREFTUNE_TEST_STEP_PAUSE="1")
    ranks.until(lambda: (out / "checkpoints" / "step-2").is_dir(), "the step-2 checkpoint")
    ranks.procs[1].kill()
    codes = ranks.wait(timeout=20 + 120)  # the collective timeout, plus start-up slack on a busy machine
    assert codes[0] not in (EXIT_OK, EXIT_PREEMPTED) and codes[1] == -signal.SIGKILL
    again = launch(tmp_path, out, data_dir, "second")
    assert again.wait() == [EXIT_OK, EXIT_OK], again.text(0)[-3000:]
    assert_bitwise(two_rank_run, out)


def test_two_rank_checkpoint_resumes_on_one_process(two_rank_run, one_rank_run, data_dir, tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(two_rank_run / "checkpoints" / "step-2", out / "checkpoints" / "step-2")
    train_one_process(args(out, data_dir))
    assert_continues_like(two_rank_run, out, 3)
    assert_continues_like(one_rank_run, out, 3)


def _resumed_on_two_ranks(source, data_dir, tmp_path):
    """A new run folder holding `source`'s step-2 checkpoint, resumed by 2 ranks (both exit 0)."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    shutil.copytree(source / "checkpoints" / "step-2", out / "checkpoints" / "step-2")
    ranks = launch(tmp_path, out, data_dir, "resume")
    assert ranks.wait() == [EXIT_OK, EXIT_OK], ranks.text(0)[-3000:]
    return out, ranks


def test_one_process_checkpoint_resumes_on_two_ranks(one_rank_run, data_dir, tmp_path):
    out, ranks = _resumed_on_two_ranks(one_rank_run, data_dir, tmp_path)
    assert "resuming a 1-rank checkpoint on 2 ranks" in ranks.text(0)
    assert_continues_like(one_rank_run, out, 3)


def test_export_writes_the_same_model_from_sharded_and_full_checkpoints(two_rank_run, one_rank_run, tmp_path):

    a, b = tmp_path / "from-sharded", tmp_path / "from-full"
    assert main(["export", str(two_rank_run / "checkpoints" / "step-4"), "-o", str(a)]) == EXIT_OK
    assert main(["export", str(one_rank_run / "checkpoints" / "step-4"), "-o", str(b)]) == EXIT_OK
    wa, wb = folder_state(a), folder_state(b)
    assert max((wa[k] - wb[k]).abs().max().item() for k in wa) < WEIGHT_TOL
    assert all(torch.equal(v, final_state(two_rank_run)[k]) for k, v in wa.items())
    assert ckpt.verify(a) is None
    assert main(["export", str(two_rank_run / "checkpoints" / "step-4"), "-o", str(a)]) == 78  # not empty


OFFLOAD = {"distributed.cpu_offload": "true"}


@pytest.fixture(scope="module")
def offload_run(data_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("offload")
    ranks = launch(tmp, tmp / "run", data_dir, "offload", OFFLOAD)
    assert ranks.wait() == [EXIT_OK, EXIT_OK], ranks.text(0)[-3000:]
    assert "parameters and optimizer state in host memory" in ranks.text(1)
    return tmp / "run"


def test_cpu_offload_trains_bitwise_as_without(two_rank_run, offload_run):
    """On a CPU the offloaded step is the same computation (host shards, CPU AdamW) as the plain
    FSDP2 one: equal losses and final weights, bit for bit."""
    assert [(r["loss"], r["grad_norm"]) for r in metric_rows(offload_run)] == \
        [(r["loss"], r["grad_norm"]) for r in metric_rows(two_rank_run)]
    assert_bitwise(two_rank_run, offload_run)


def test_sigterm_with_cpu_offload_resumes_exactly(offload_run, data_dir, tmp_path):
    out = tmp_path / "run"
    ranks = launch(tmp_path, out, data_dir, "first", OFFLOAD, PREFTUNE_TEST_STEP_PAUSE="1")
    ranks.until(lambda: (out / "checkpoints" / "step-2").is_dir(), "the step-2 checkpoint")
    os.kill(ranks.procs[0].pid, signal.SIGTERM)
    assert ranks.wait() == [EXIT_PREEMPTED, EXIT_PREEMPTED], ranks.text(0)[-2000:]
    again = launch(tmp_path, out, data_dir, "second", OFFLOAD)
    assert again.wait() == [EXIT_OK, EXIT_OK], again.text(0)[-3000:]
    assert "resumed from" in again.text(0)
    assert_bitwise(offload_run, out)


def test_cpu_offload_may_be_switched_off_on_a_resume(two_rank_run, offload_run, data_dir, tmp_path):
    """A free change (it moves memory, not the trajectory): logged, and the run ends as the
    uninterrupted one without offload."""
    out, ranks = _resumed_on_two_ranks(offload_run, data_dir, tmp_path)
    assert "distributed.cpu_offload: True -> False" in ranks.text(0)
    assert_bitwise(two_rank_run, out)
