"""Smoke tests of bench/: both benches at a minimal size, in process (one TRL import for the file)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")

from bench import bench_dpo, bench_grpo  # noqa: E402


def _check_result(record: dict, timed: int) -> None:
    assert set(record["results"]) == {"preftune", "trl"}
    for r in record["results"].values():
        assert r["timed_steps"] == timed
        assert 0 < r["median_s"] and 0 < r["mean_s"]
        assert r["steps_per_s"] == pytest.approx(1 / r["mean_s"])
    ratio = record["ratio_trl_over_preftune"]
    res = record["results"]
    assert ratio["median"] == pytest.approx(res["trl"]["median_s"] / res["preftune"]["median_s"])


def test_grpo_bench_runs_both_and_prints_ratio(tmp_path, capsys):
    out = tmp_path / "grpo.json"
    record = bench_grpo.main(["--steps", "2", "--warmup", "1", "--prompts", "2", "--generations", "2",
                              "--eval", "--in-process", "--json", str(out)])
    _check_result(record, timed=1)
    assert json.loads(out.read_text())["results"].keys() == record["results"].keys()
    for r in record["results"].values():
        assert "eval acc before->after" in r["extra"]
    text = capsys.readouterr().out
    assert "TRL / preftune" in text and "median s/step" in text


def test_dpo_bench_same_pairs_for_both():
    record = bench_dpo.main(["--steps", "2", "--warmup", "1", "--batch", "16", "--in-process"])
    _check_result(record, timed=1)
    pairs = {r["extra"]["pairs"] for r in record["results"].values()}
    assert len(pairs) == 1 and int(pairs.pop()) > 0


def test_dpo_data_without_traces_writes_synthetic_pairs(tmp_path):
    from preftune.data.pairs import read_pairs

    path, pairs = bench_dpo.dpo_data(tmp_path / "missing.parquet", str(tmp_path))
    assert path != str(tmp_path / "missing.parquet")
    stored = read_pairs(path)  # what preftune trains on
    assert [(p.prompt, p.chosen, p.rejected) for p in stored] == [(p.prompt, p.chosen, p.rejected) for p in pairs]
    assert all(p.chosen != p.rejected for p in pairs)


@pytest.mark.parametrize("module", [bench_grpo, bench_dpo])
def test_worker_command_line_reproduces_the_settings(module):
    """The subprocess worker must see exactly the parent's settings (all but the orchestration flags)."""
    ap = module.build_parser()
    args = ap.parse_args(["--steps", "7", "--warmup", "2", "--seed", "3"])
    child = ap.parse_args(bench_grpo.child_argv(args, "trl", "r.json"))
    assert (child.only, child.json, child.worker) == ("trl", "r.json", True)
    skip = {"only", "json", "worker", "in_process"}
    assert {k: v for k, v in vars(child).items() if k not in skip} == \
        {k: v for k, v in vars(args).items() if k not in skip}


def test_steps_must_exceed_warmup():
    with pytest.raises(SystemExit):
        bench_grpo.main(["--steps", "3", "--warmup", "3"])
