"""The gate's decision (lower bound, not the mean; length growth; min reward) and `preftune eval`
end to end: exit 0 / 3 (gate failed) / 1 (crash) / 78, eval.json, registry appends only on a pass, same prompts and seeds."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch

from preftune.cli.command import main
from preftune.config import GateConfig
from preftune.errors import EXIT_CRASH, EXIT_GATE_FAILED, EXIT_USER
from preftune.evaluation.gate import compare, decide
from preftune.evaluation.registry import read
from tests.conftest import EVAL_PROMPTS, MODEL_DIR


def test_a_pass_needs_the_lower_bound_above_the_threshold_not_just_the_mean():
    base = torch.zeros(40)
    noisy = torch.tensor([1.0, -1.0, 1.0, 0.0] * 10)  # mean +0.25 but widely spread
    gate = GateConfig(min_improvement=0.1, bootstrap_samples=2000)
    c = compare(noisy, base, gate, seed=0, ckpt_length=3.0, base_length=3.0)
    assert c["improvement"] == pytest.approx(0.25) and c["improvement_lower"] < 0.1
    v = decide(gate, {"reward": 0.25}, c)
    assert not v.passed and "lower bound" in v.reason and "gate.min_improvement 0.1" in v.reason
    steady = torch.tensor([1.0, 0.0, 0.0, 0.0] * 10) + 0.2  # mean 0.45, spread small enough
    c = compare(steady, base, gate, seed=0, ckpt_length=3.0, base_length=3.0)
    assert c["improvement_lower"] > 0.1 and decide(gate, {"reward": 0.45}, c).passed


def test_length_growth_and_min_reward_checks_and_nan_rows():
    gate = GateConfig(min_reward=0.5, max_length_growth=1.5)
    ck = torch.tensor([1.0, float("nan"), 1.0])
    c = compare(ck, torch.tensor([0.0, 1.0, float("nan")]), gate, 0, ckpt_length=6.0, base_length=3.0)
    assert c["paired_prompts"] == 1 and c["length_growth"] == 2.0
    v = decide(gate, {"reward": 0.4}, c)
    assert not v.passed and [x["name"] for x in v.checks if not x["passed"]] == ["min_reward", "max_length_growth"]
    assert decide(GateConfig(), {"reward": 0.0}, None).reason == "passed: no gate threshold is set"
    assert not decide(GateConfig(min_reward=0.0), {"reward": float("nan")}, None).passed


@pytest.fixture
def models(tmp_path):
    """Two model folders: a copy of the embedded base, and a copy with its weights disturbed (a worse model)."""
    from transformers import AutoModelForCausalLM

    ckpt = shutil.copytree(MODEL_DIR, tmp_path / "ckpt")
    worse = shutil.copytree(MODEL_DIR, tmp_path / "worse")
    m = AutoModelForCausalLM.from_pretrained(str(worse))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    m.save_pretrained(str(worse))
    return ckpt, worse


def _config(tmp_path, **gate) -> list[str]:
    cfg = tmp_path / "eval.yaml"
    cfg.write_text("{}\n")
    ovr = [f"output_dir={tmp_path / 'run'}", f"data.train={EVAL_PROMPTS}", f"data.eval={EVAL_PROMPTS}",
           "data.max_prompt_length=16", "grpo.max_completion_length=4", "eval.num_samples=4",
           f"gate.registry={tmp_path / 'registry.jsonl'}"] + [f"gate.{k}={v}" for k, v in gate.items()]
    return [str(cfg), *ovr]


def test_eval_pass_writes_eval_json_and_appends_to_the_registry(tmp_path, models, capsys):
    ckpt, worse = models
    cfg, *ovr = _config(tmp_path, min_improvement=0.05, max_length_growth=2.0, min_reward=0.2)
    assert main(["eval", cfg, "--checkpoint", str(ckpt), "--baseline", str(worse), *ovr]) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out
    report = json.loads((ckpt / "eval.json").read_text())
    m, b = report["metrics"]["checkpoint"], report["metrics"]["baseline"]
    assert report["verdict"] == "pass" and report["prompts"] == 100 and report["gate"]["min_improvement"] == 0.05
    assert m["reward"] == pytest.approx(0.33) and b["reward"] < 0.2  # the embedded base: 33% greedy
    for key in ("rewards/accuracy/mean", "completions/mean_length", "sampled/pass@4", "sampled/mean@4", "sampled/pass@4/accuracy"):
        assert key in m and key in b
    assert m["sampled/pass@4"] >= m["sampled/mean@4"]
    assert report["comparison"]["improvement"] == pytest.approx(m["reward"] - b["reward"])
    assert report["comparison"]["improvement_lower"] > 0.05
    (rec,) = read(str(tmp_path / "registry.jsonl"))
    assert rec["model_path"] == str(ckpt) and rec["verdict"] == "pass" and rec["metrics"]["reward"] == m["reward"]
    assert len(rec["config_hash"]) == 64 and len(rec["data_fingerprint"]) == 64 and rec["preftune_version"]
    assert rec["base_model"] and rec["time"]


def test_eval_fail_exits_3_with_the_reason_and_registers_nothing(tmp_path, models, capsys):
    ckpt, worse = models
    cfg, *ovr = _config(tmp_path, min_improvement=0.05)
    assert EXIT_GATE_FAILED == 3 and EXIT_GATE_FAILED not in (0, EXIT_CRASH, 69, 75, EXIT_USER)
    assert main(["eval", cfg, "--checkpoint", str(worse), "--baseline", str(ckpt), *ovr]) == EXIT_GATE_FAILED
    report = json.loads((worse / "eval.json").read_text())
    assert report["verdict"] == "fail" and "gate.min_improvement" in report["reason"]
    assert not (tmp_path / "registry.jsonl").exists()


def test_an_evaluation_that_crashes_exits_1_not_the_gate_code(tmp_path, models):
    """A pipeline must tell "the model is worse" (3) from "the evaluation broke" (1): the `preftune`
    process, with the evaluation raising an unexpected error, exits 1 with a traceback."""
    ckpt, _ = models
    cfg, *ovr = _config(tmp_path, min_reward=0.0)
    code = ("import sys; import preftune.cli.evaluate as ev\n"
            "def boom(*a, **k): raise RuntimeError('the evaluation broke')\n"
            "ev.evaluate_model = boom\n"
            "from preftune.cli.command import script; script(sys.argv[1:])")
    proc = subprocess.run([sys.executable, "-c", code, "eval", cfg, "--checkpoint", str(ckpt), *ovr],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == EXIT_CRASH, proc.stderr[-2000:]
    assert "RuntimeError: the evaluation broke" in proc.stderr and not (ckpt / "eval.json").exists()


def test_same_prompts_and_seeds_for_checkpoint_and_baseline(tmp_path, models):
    ckpt, _ = models
    cfg, *ovr = _config(tmp_path)
    assert main(["eval", cfg, "--checkpoint", str(ckpt), "--baseline", str(MODEL_DIR), *ovr]) == 0
    report = json.loads((ckpt / "eval.json").read_text())
    assert report["metrics"]["checkpoint"] == report["metrics"]["baseline"]  # same weights: same samples
    assert report["comparison"]["improvement"] == 0.0


def test_config_and_data_errors_exit_78(tmp_path, models, capsys):
    ckpt, _ = models
    cfg, *ovr = _config(tmp_path, min_improvement=0.0)
    assert main(["eval", cfg, "--checkpoint", str(ckpt), *ovr]) == EXIT_USER
    assert "gate.min_improvement: needs a baseline" in capsys.readouterr().err
    assert main(["eval", cfg, "--checkpoint", str(tmp_path / "nope"), *ovr[:-1]]) == EXIT_USER
    assert "no such model folder" in capsys.readouterr().err
    no_eval = [o for o in ovr[:-1] if not o.startswith("data.eval")]
    assert main(["eval", cfg, "--checkpoint", str(ckpt), *no_eval]) == EXIT_USER
    assert "no held-out prompts" in capsys.readouterr().err
    assert not (ckpt / "eval.json").exists()


def test_sigterm_during_eval_says_what_stopped_and_exits_75(tmp_path, models):
    """Issue 25: it said "during start-up; nothing was written" while the evaluation was running."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from tests.conftest import ROOT

    ckpt, _ = models
    driver = tmp_path / "driver.py"
    driver.write_text("import sys, time\nimport preftune.cli.evaluate as ev\nreal = ev.evaluate_model\n"
                      "def slow(*a, **k):\n    print('TEST evaluating', flush=True)\n    time.sleep(60)\n"
                      "    return real(*a, **k)\nev.evaluate_model = slow\nfrom preftune.cli.command import script\n"
                      "script(sys.argv[1:])\n")
    cfg, *ovr = _config(tmp_path)
    log = tmp_path / "eval.log"
    with open(log, "w") as f:
        p = subprocess.Popen([sys.executable, str(driver), "eval", cfg, "--checkpoint", str(ckpt), *ovr], stdout=f,
                             stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONPATH=str(ROOT)), cwd=tmp_path)
    end = time.monotonic() + 240
    while "TEST evaluating" not in log.read_text():
        assert p.poll() is None and time.monotonic() < end, log.read_text()[-2000:]
        time.sleep(0.1)
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 75, log.read_text()[-2000:]
    line = log.read_text().strip().splitlines()[-1]
    assert "SIGTERM during evaluation; eval.json was not written" in line, line
    assert not (ckpt / "eval.json").exists()
