"""TRL's logging with logging_steps > 1: a record holds the mean over the window's steps
(learning_rate and grad_norm the last step's, num_tokens the running total), also across a resume."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from preftune.run.loop import Run
from preftune.run.metrics import Window
from preftune.distributed.group import Parallel


def test_window_means_and_last_values():
    w = Window()
    w.add({"loss": 1.0, "kl": math.nan, "learning_rate": 1e-3, "grad_norm": 2.0, "num_tokens": 10})
    w.add({"loss": 3.0, "kl": 0.5, "learning_rate": 5e-4, "grad_norm": 4.0, "num_tokens": 25})
    restored = Window(json.loads(json.dumps(w.state_dict())))  # a checkpoint holds plain data
    for win in (w, restored):
        rec = win.take()
        assert rec["loss"] == 2.0 and rec["kl"] == 0.5  # a NaN step is left out of the mean
        assert (rec["learning_rate"], rec["grad_norm"], rec["num_tokens"]) == (5e-4, 4.0, 25)
        assert win.take() == {}  # taken: a new window


def test_a_window_of_nan_only_is_nan():
    w = Window()
    w.add({"clip_ratio/low_min": math.nan})
    assert math.isnan(w.take()["clip_ratio/low_min"])


def _train(make_config, name: str, *overrides) -> list[dict]:
    cfg = make_config("max_steps=4", *overrides)
    cfg.output_dir = str(Path(cfg.output_dir).parent / name)
    Run(cfg, dp=Parallel()).run()
    lines = (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if "loss" in r]


VARYING = ("entropy", "completions/mean_length", "completions/max_length")  # differ from step to step here


def test_logging_steps_logs_the_windows_mean(make_config):
    every = _train(make_config, "every", "log.logging_steps=1")
    windowed = _train(make_config, "windowed", "logging_steps=2")  # TRL's flat name
    assert [r["step"] for r in windowed] == [2, 4]
    for rec, (a, b) in zip(windowed, [every[0:2], every[2:4]]):
        for key in ("loss", "reward", "rewards/accuracy/mean", *VARYING):
            assert rec[key] == pytest.approx((a[key] + b[key]) / 2, rel=1e-6, abs=1e-9), key
        assert rec["learning_rate"] == b["learning_rate"] and rec["grad_norm"] == b["grad_norm"]
        assert rec["num_tokens"] == b["num_tokens"] > a["num_tokens"] > 0  # the running total
    assert any(every[1][k] != every[0][k] for k in VARYING)  # so the mean is not the last step's value


def test_a_resume_inside_a_window_writes_the_same_record(make_config, tmp_path):
    every = _train(make_config, "every", "log.logging_steps=1")
    whole = _train(make_config, "whole", "log.logging_steps=2", "save_steps=3")  # step-3: inside the window 3-4
    step3 = Path(make_config().output_dir).parent / "whole" / "checkpoints" / "step-3"
    again = _train(make_config, "resumed", "log.logging_steps=2", f"resume={step3}")
    assert [r["step"] for r in again] == [2, 4]
    for key in ("loss", "reward", "num_tokens", *VARYING):
        assert again[-1][key] == pytest.approx(whole[-1][key], rel=1e-6), key
    assert any(again[-1][k] != every[-1][k] for k in VARYING)  # step 3 is in the record
