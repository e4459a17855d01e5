"""Exact resume, in process: a run stopped by a real SIGTERM (sent by the process to itself during a
chosen step) and resumed ends with bitwise-identical weights and identical metrics records as the
uninterrupted run, for online GRPO (with sampling), offline GRPO, DPO and KTO, at several points.
Also: a damaged newest checkpoint, resume=PATH, resume=never, and the config-difference refusal."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from preftune.cli.command import main
from preftune.config import load_config
from preftune.errors import EXIT_PREEMPTED, EXIT_USER, Preempted, UserError
from preftune.run import checkpoint_folders as ckpt, loop
from preftune.run.metrics import TIMING_KEYS
from preftune.run.resume import find_resume_point
from tests.hf_folder import folder_state

ROOT = Path(__file__).resolve().parents[2]
MODEL, DATA = ROOT / "examples" / "model", ROOT / "examples" / "data"


# ---------------------------------------------------------------- helpers (also used by the other test files)


def small_traces(folder: Path, n_prompts: int = 24) -> Path:
    """Labeled traces for the first training prompts: the right answer (reward 1) and three wrong
    ones (lower rewards), so both DPO pairs and offline GRPO groups exist."""
    path = folder / "traces.parquet"
    if not path.exists():
        rows = []
        for line in (DATA / "train_prompts.jsonl").read_text().splitlines()[:n_prompts]:
            prompt, answer = json.loads(line)["input"], int(json.loads(line)["answer"])
            for delta, reward in ((0, 1.0), (1, 0.4), (3, 0.2), (10, 0.05)):
                rows.append({"input": prompt, "output": str(answer + delta), "final_reward": reward})
        pd.DataFrame(rows).to_parquet(path)
    return path


def small_eval(folder: Path, n: int = 6) -> Path:
    path = folder / "eval.jsonl"
    lines = (DATA / "eval_prompts.jsonl").read_text().splitlines()[:n]
    path.write_text("\n".join(lines) + "\n")
    return path


def overrides(kind: str, out: Path, data_dir: Path, **extra) -> list[str]:
    """A tiny run: a few steps of a few sequences on the embedded ~1M-parameter model."""
    o = {"output_dir": out, "model.name_or_path": MODEL, "log.progress_bar": "false", "seed": 0, "max_steps": 5,
         "save_steps": 2, "optim.lr": 3.0e-4, "data.max_prompt_length": 16}
    if kind == "dpo":
        o |= {"algorithm": "dpo", "data.train": small_traces(data_dir), "dpo.batch_size": 4,
              "dpo.micro_batch_size": 2, "dpo.max_length": 24}
    elif kind == "kto":
        o |= {"algorithm": "kto", "data.train": small_traces(data_dir), "kto.batch_size": 4,
              "kto.micro_batch_size": 2, "kto.max_length": 24}
    elif kind == "sft":
        o |= {"algorithm": "sft", "data.train": small_traces(data_dir), "sft.min_reward": 0.2, "sft.batch_size": 4,
              "sft.micro_batch_size": 2, "sft.max_length": 24}
    else:
        o |= {"grpo.prompts_per_step": 2, "grpo.num_generations": 4, "grpo.max_completion_length": 4,
              "grpo.micro_batch_size": 256}
        if kind == "online":
            o |= {"data.train": DATA / "train_prompts.jsonl", "grpo.reward_funcs": "[accuracy]"}
        else:
            o |= {"data.train": small_traces(data_dir), "grpo.rollout": "offline"}
    o |= extra
    return [f"{k}={v}" for k, v in o.items()]


def final_weights(out: Path) -> dict[str, torch.Tensor]:
    return folder_state(out / "final")


def records(out: Path) -> list[dict]:
    """metrics.jsonl without the timing fields (the only fields allowed to differ)."""
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in rows]


def assert_same_run(reference: Path, resumed: Path) -> None:
    a, b = final_weights(reference), final_weights(resumed)
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"weights differ bitwise in {differ[:5]}"
    ra, rb = records(reference), records(resumed)
    assert [r["step"] for r in ra] == [r["step"] for r in rb]
    assert ra == rb


def sigterm_during(monkeypatch, step: int, when: str = "after") -> None:
    """Make the run send itself SIGTERM during step `step`: "after" its forward/backward (the step
    finishes), or "before" it (with grace 0 the step is then abandoned). "scramble" is "before" after
    drawing from every global RNG first, as an abandoned step's partial work would."""
    build = loop.build_task

    def patched(*args, **kwargs):
        task = build(*args, **kwargs)
        inner = task.step

        def step_fn(model, n, stop):
            if n == step and when == "scramble":
                random.random(), np.random.rand(), torch.rand(1)
            if n == step and when != "after":
                os.kill(os.getpid(), signal.SIGTERM)
            out = inner(model, n, stop)
            if n == step and when == "after":
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        task.step = step_fn
        return task

    monkeypatch.setattr(loop, "build_task", patched)


def train_until_preempted(ovr: list[str], monkeypatch, step: int, when: str = "after") -> str:
    """One interrupted segment; returns what the run said (e.g. 'checkpoint step-3 saved')."""
    with monkeypatch.context() as m:
        sigterm_during(m, step, when)
        with pytest.raises(Preempted) as info:
            loop.train(load_config(None, ovr))
    return str(info.value)


def saved_steps(out: Path) -> list[int]:
    return [s for s, _ in ckpt.list_checkpoints(out / "checkpoints")]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: far faster for this tiny model on a busy 2-core machine, and every run
    compared in a module uses the same setting (results may depend on it)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="module")
def reference(data_dir, tmp_path_factory):
    """Uninterrupted runs, one per (kind, extra overrides), computed once per module."""
    cache: dict = {}

    def get(kind: str, **extra) -> Path:
        key = (kind, tuple(sorted(extra.items())))
        if key not in cache:
            out = tmp_path_factory.mktemp(f"ref-{kind}")
            loop.train(load_config(None, overrides(kind, out, data_dir, **extra)))
            cache[key] = out
        return cache[key]

    return get


# ---------------------------------------------------------------- exactness

EXACT_CASES = {
    # kind, extra overrides, [(step that gets the SIGTERM, when)]; with the default grace a step
    # signalled before it starts still finishes, with grace 0 it is abandoned and rolled back
    "online": ("online", {}, [(1, "after"), (3, "after")]),
    # steps 1, 3, 5 generate, 2 and 4 reuse: a save after step 3 carries the pending batch (and ref log-probs)
    "online-reuse-kl": ("online", {"grpo.num_iterations": 2, "grpo.beta": 0.04}, [(3, "after")]),
    "online-abandoned": ("online", {"save_steps": 0, "preemption_grace_seconds": 0}, [(3, "before"), (4, "before")]),
    # LoRA dropout draws from the global torch RNG: the checkpoint's and the abandoned step's RNG matter
    "online-lora-dropout": ("online", {"model.lora.enabled": "true", "model.lora.r": 4, "model.lora.dropout": 0.1,
                                       "save_steps": 0, "preemption_grace_seconds": 0},
                            [(2, "after"), (4, "scramble")]),
    "offline": ("offline", {}, [(2, "after"), (4, "after")]),
    "dpo": ("dpo", {"save_steps": 3}, [(1, "after"), (4, "before")]),
    # the checkpoint carries the reference log-probs (matched and mismatched) and the batch order
    "kto": ("kto", {"save_steps": 3}, [(1, "after"), (4, "before")]),
}


@pytest.mark.parametrize("case", list(EXACT_CASES))
def test_interrupted_and_resumed_run_equals_uninterrupted(case, reference, data_dir, tmp_path, monkeypatch):
    kind, extra, points = EXACT_CASES[case]
    ref = reference(kind, **extra)
    ovr = overrides(kind, tmp_path / "run", data_dir, **extra)
    abandons = extra.get("preemption_grace_seconds") == 0
    for step, when in points:
        said = train_until_preempted(ovr, monkeypatch, step, when)
        stopped = step - 1 if abandons and when != "after" else step
        assert f"preempted at step {stopped};" in said
    loop.train(load_config(None, ovr))
    assert_same_run(ref, tmp_path / "run")


def test_abandoned_step_rolls_back_before_saving(reference, data_dir, tmp_path, monkeypatch):
    """Grace 0 and the signal before step 3: step 3 is not trained, the checkpoint is step 2."""
    extra = {"save_steps": 0, "preemption_grace_seconds": 0}
    ovr = overrides("online", tmp_path / "run", data_dir, **extra)
    said = train_until_preempted(ovr, monkeypatch, 3, "before")
    assert "checkpoint step-2 saved" in said and saved_steps(tmp_path / "run") == [2]
    assert [r["step"] for r in records(tmp_path / "run")] == [1, 2]


def test_damaged_newest_checkpoint_is_skipped_for_the_previous(reference, data_dir, tmp_path, monkeypatch, caplog):
    ref = reference("online")
    out = tmp_path / "run"
    ovr = overrides("online", out, data_dir)
    train_until_preempted(ovr, monkeypatch, 4)
    assert saved_steps(out) == [4, 2]
    weights = out / "checkpoints" / "step-4" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, one flipped byte
    weights.write_bytes(bytes(data))
    with caplog.at_level("INFO", logger="preftune"):
        loop.train(load_config(None, ovr))
    assert "skipping damaged checkpoint" in caplog.text and "step-4" in caplog.text
    assert "resumed from" in caplog.text and "step-2" in caplog.text
    assert (out / "checkpoints" / "damaged-step-4").is_dir()
    assert_same_run(ref, out)


def test_resume_from_a_given_checkpoint_path(reference, data_dir, tmp_path):
    ref = reference("online")
    out = tmp_path / "elsewhere"
    loop.train(load_config(None, overrides("online", out, data_dir, resume=ref / "checkpoints" / "step-2")))
    assert_same_run(ref, out)  # the records up to step 2 came with the checkpoint


def test_resumed_finished_run_adds_no_records(reference, data_dir, tmp_path):
    """A run killed after its end checkpoint but before final/ was published redoes only the
    final evaluation and final/."""
    extra = {"data.eval": small_eval(data_dir), "eval.eval_steps": 2, "save_steps": 5}
    ref = reference("online", **extra)
    out = tmp_path / "copy"
    shutil.copytree(ref, out)
    shutil.rmtree(out / "final")
    loop.train(load_config(None, overrides("online", out, data_dir, **extra)))
    assert [r["step"] for r in records(out) if "eval/reward" in r] == [0, 2, 4, 5]  # the final one once
    assert_same_run(ref, out)


def test_eval_records_survive_resume(reference, data_dir, tmp_path, monkeypatch):
    extra = {"data.eval": small_eval(data_dir), "eval.eval_steps": 2}
    ref = reference("online", **extra)
    ovr = overrides("online", tmp_path / "run", data_dir, **extra)
    train_until_preempted(ovr, monkeypatch, 2)
    loop.train(load_config(None, ovr))
    assert [r["step"] for r in records(ref) if "eval/reward" in r] == [0, 2, 4, 5]
    assert_same_run(ref, tmp_path / "run")


# ---------------------------------------------------------------- refusals


def write_config(path: Path) -> Path:
    """An empty YAML file: the tests pass everything as KEY=VALUE overrides."""
    path.write_text("{}\n")
    return path


def test_config_difference_is_refused_with_the_list(reference, data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    shutil.copytree(reference("online"), out)
    cfg = write_config(tmp_path / "run.yaml")
    ovr = overrides("online", out, data_dir, seed=1, **{"grpo.num_generations": 8, "optim.lr": 1e-5})
    before = sorted(p.name for p in out.rglob("*"))
    assert main(["train", str(cfg), *ovr]) == EXIT_USER
    err = capsys.readouterr().err
    assert "refusing to resume" in err and "seed: 0 -> 1" in err and "grpo.num_generations: 4 -> 8" in err
    assert "optim.lr: 0.0003 -> 1e-05" in err  # refused too (tests/run/test_resume_changes.py)
    assert len(err.strip().splitlines()) == 5  # the refusal, one line per key, the ways forward
    assert sorted(p.name for p in out.rglob("*")) == before  # refused before touching anything


def test_resume_never_refuses_a_non_empty_output_dir(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    cfg = write_config(tmp_path / "run.yaml")
    assert main(["train", str(cfg), *overrides("online", out, data_dir, resume="never")]) == EXIT_USER
    assert "not empty" in capsys.readouterr().err and (out / "notes.txt").exists()
    fresh = load_config(None, overrides("online", out, data_dir, resume="never", overwrite_output_dir="true"))
    assert find_resume_point(fresh, out, out / "checkpoints", None) is None and not out.exists()


def test_resume_refuses_a_checkpoint_that_does_not_match_its_manifest(reference, data_dir, tmp_path):
    folder = tmp_path / "step-2"
    shutil.copytree(reference("online") / "checkpoints" / "step-2", folder)
    (folder / "trainer_state.safetensors").write_bytes(b"garbage")
    cfg = load_config(None, overrides("online", tmp_path / "run", data_dir, resume=folder))
    with pytest.raises(UserError, match="checksum|bytes"):
        find_resume_point(cfg, tmp_path / "run", tmp_path / "run" / "checkpoints", None)


def test_preempted_exit_code_through_the_cli(data_dir, tmp_path, monkeypatch, capsys):
    cfg = write_config(tmp_path / "run.yaml")
    sigterm_during(monkeypatch, 1)
    assert main(["train", str(cfg), *overrides("online", tmp_path / "run", data_dir)]) == EXIT_PREEMPTED
    assert "checkpoint step-1 saved" in capsys.readouterr().err
    assert saved_steps(tmp_path / "run") == [1]
