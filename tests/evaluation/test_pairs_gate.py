"""`preftune eval` on held-out pairs: TRL's DPO metrics (the numbers DPO training's own eval logs),
the gate's `min_accuracy` and a paired accuracy comparison with a baseline, exit 0 / 3 / 78."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from preftune.cli.command import main
from preftune.config import GateConfig
from preftune.errors import EXIT_GATE_FAILED, EXIT_USER
from preftune.evaluation.gate import compare, decide
from preftune.distributed.group import Parallel
from tests.conftest import EVAL_PROMPTS, MODEL_DIR, write_parquet

PAIRS = [{"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(a + b + 1)}
         for a, b in ((1, 2), (5, 5), (7, 1), (3, 3), (2, 6), (4, 1))]


def _overrides(tmp_path, pairs: Path, *more: str) -> list[str]:
    return [f"output_dir={tmp_path / 'run'}", f"model.name_or_path={MODEL_DIR}", "algorithm=dpo",
            f"data.train={pairs}", f"data.eval={pairs}", "data.max_prompt_length=16", "data.shuffle=false",
            "dpo.batch_size=6", "dpo.micro_batch_size=3", "log.progress_bar=false", "save_steps=0", *more]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A short DPO run on the pairs it is then evaluated on (so it ranks them better than the base)."""
    from preftune.config import load_config
    from preftune.run.loop import Run

    tmp_path = tmp_path_factory.mktemp("pairs_gate")
    pairs = write_parquet(tmp_path / "pairs.parquet", PAIRS)
    cfg = tmp_path / "dpo.yaml"
    cfg.write_text("{}\n")
    Run(load_config(str(cfg), _overrides(tmp_path, pairs, "max_steps=6", "optim.lr=1e-2")), dp=Parallel()).run()
    records = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    last_eval = [r for r in records if "eval/loss" in r][-1]
    return tmp_path, pairs, cfg, last_eval


def test_the_gate_reports_what_training_evaluated_and_passes_a_better_model(trained, capsys):
    tmp_path, pairs, cfg, last_eval = trained
    final = tmp_path / "run" / "final"
    ovr = _overrides(tmp_path, pairs, "gate.min_accuracy=0.5", "gate.min_improvement=0.0")
    assert main(["eval", str(cfg), "--checkpoint", str(final), "--baseline", str(MODEL_DIR), *ovr]) == 0
    out = capsys.readouterr().out
    assert "verdict: PASS" in out and "pair accuracy improvement" in out and f"{len(PAIRS)} pairs)" in out
    report = json.loads((final / "eval.json").read_text())
    m, b = report["metrics"]["checkpoint"], report["metrics"]["baseline"]
    assert report["pairs"] == len(PAIRS) and m["num_pairs"] == len(PAIRS)
    # the same figures as the held-out eval DPO training logged after its last step
    for k in ("loss", "rewards/accuracies", "rewards/margins", "rewards/chosen", "logps/rejected",
              "mean_token_accuracy"):
        assert m[k] == pytest.approx(last_eval[f"eval/{k}"], rel=1e-4, abs=1e-6), k
    assert m["rewards/accuracies"] >= 0.5
    # the base is the reference: every implicit reward 0, no pair ranked right, loss ln 2
    assert b["rewards/accuracies"] == 0 and b["rewards/margins"] == pytest.approx(0.0, abs=1e-6)
    c = report["comparison"]
    assert c["series"] == "pair accuracy" and c["length_growth"] is None
    assert c["improvement"] == pytest.approx(m["rewards/accuracies"] - b["rewards/accuracies"])
    assert [x["name"] for x in report["checks"]] == ["min_accuracy", "min_improvement"]


def test_a_worse_model_fails_with_exit_3(trained, capsys):
    tmp_path, pairs, cfg, _ = trained
    base = tmp_path / "base_copy"
    if not base.exists():
        import shutil

        shutil.copytree(MODEL_DIR, base)
    ovr = _overrides(tmp_path, pairs, "gate.min_accuracy=0.5")
    assert main(["eval", str(cfg), "--checkpoint", str(base), *ovr]) == EXIT_GATE_FAILED
    report = json.loads((base / "eval.json").read_text())
    assert report["verdict"] == "fail" and "gate.min_accuracy 0.5" in report["reason"]


def test_thresholds_that_need_the_other_kind_of_held_out_data_exit_78(trained, capsys):
    tmp_path, pairs, cfg, _ = trained
    final = tmp_path / "run" / "final"
    before = sorted(p.name for p in final.iterdir())
    assert main(["eval", str(cfg), "--checkpoint", str(final), *_overrides(tmp_path, pairs, "gate.min_reward=0.1")]) \
        == EXIT_USER
    assert "gate.min_reward: scores generated completions, and data.eval is a pairs file" in capsys.readouterr().err
    prompts = _overrides(tmp_path, pairs, "gate.min_accuracy=0.5") + [f"data.eval={EVAL_PROMPTS}"]
    assert main(["eval", str(cfg), "--checkpoint", str(final), *prompts]) == EXIT_USER
    assert "gate.min_accuracy: needs held-out pairs" in capsys.readouterr().err
    assert sorted(p.name for p in final.iterdir()) == before


def test_min_accuracy_is_a_check_of_its_own():
    gate = GateConfig(min_accuracy=0.75, min_improvement=0.0)
    right, base = torch.tensor([1.0, 1.0, 1.0, 0.0] * 5), torch.zeros(20)
    c = compare(right, base, gate, seed=0, series="pair accuracy")
    v = decide(gate, {"rewards/accuracies": 0.75}, c)
    assert v.passed and "rewards/accuracies 0.7500 vs gate.min_accuracy 0.75" in v.reason
    v = decide(gate, {"rewards/accuracies": 0.7}, c)
    assert not v.passed and [x["name"] for x in v.checks if not x["passed"]] == ["min_accuracy"]
