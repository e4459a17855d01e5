"""Smoke tests of bench/: both benches at a minimal size, in process (one TRL import for the file)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("trl")

from bench import bench_dpo, bench_grpo, suite, workload  # noqa: E402


def _check_result(record: dict, timed: int) -> None:
    assert set(record["results"]) == {"preftune", "trl"}
    for r in record["results"].values():
        assert r["timed_steps"] == timed
        assert 0 < r["median_s"] and 0 < r["mean_s"]
        assert r["steps_per_s"] == pytest.approx(1 / r["mean_s"])
        assert r["completion_tokens_per_s"] > 0 and r["flops_per_step"] > 0 and r["peak_rss_mb"] > 0
        assert r["phase_gflops"] and all(v > 0 for v in r["phase_gflops"].values())
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


def test_grpo_bench_long_shared_prompts_kl_and_reuse(tmp_path):
    """The suite's GRPO knobs: random-init model, shared prefix, beta > 0, num_iterations 2."""
    record = bench_grpo.main(["--steps", "2", "--warmup", "1", "--prompts", "1", "--generations", "4",
                              "--max-new-tokens", "4", "--model", "rand3m", "--model-cache", str(tmp_path),
                              "--reward", "digits", "--prompt-prefix", "40", "--beta", "0.04",
                              "--num-iterations", "2", "--in-process"])
    _check_result(record, timed=1)
    for r in record["results"].values():
        assert {"sampling", "reference", "forward", "backward"} <= set(r["phase_gflops"])
    res = record["results"]
    assert res["preftune"]["flops_per_step"] == pytest.approx(res["trl"]["flops_per_step"], rel=0.2)


def test_suite_alternates_and_pools():
    assert suite.order(0) == ("preftune", "trl") and suite.order(1) == ("trl", "preftune")
    runs = [{"step_times": [1.0, 3.0], "median_s": 2.0, "completion_tokens_per_s": 50.0, "flops_per_step": 1e9,
             "peak_rss_mb": 100.0, "phase_gflops": {"forward": 2.0}, "load_avg": [1.0, 1.0]},
            {"step_times": [2.0], "median_s": 2.0, "completion_tokens_per_s": 50.0, "flops_per_step": 1e9,
             "peak_rss_mb": 120.0, "phase_gflops": {"forward": 4.0}, "load_avg": [2.0, 2.0]}]
    pooled = suite.pool(runs)
    assert pooled["median_s"] == 2.0 and pooled["steps"] == 3 and pooled["peak_rss_mb"] == 120.0
    assert pooled["completion_tokens_per_s"] == 50.0 and pooled["phase_gflops"] == {"forward": 3.0}
    row = {"preftune": dict(pooled), "trl": dict(pooled, median_s=4.0, peak_rss_mb=240.0)}
    suite.add_mfu(row, peak_gflops=1.0)
    assert row["preftune"]["mfu"] == pytest.approx(0.5) and row["trl"]["mfu"] == pytest.approx(0.25)
    text = suite.table({"w": row}, peak=1.0, loads=(0.5, 0.7))
    assert "| w | 2.000 | 4.000 | 2.00x |" in text and "load average 0.50 before" in text
    argv = suite.worker_argv("grpo", "--prompts 2", "trl", "o.json", 3, 1, "c")
    assert argv[1].endswith("bench_grpo.py") and argv[2:] == [
        "--prompts", "2", "--steps", "3", "--warmup", "1", "--model-cache", "c", "--only", "trl", "--json", "o.json",
        "--worker"]


def test_suite_cases_parse():
    """Every row of both sizes is a valid command line of its bench script."""
    for cases, *_ in suite.SIZES.values():
        for name, script, options in cases:
            module = bench_grpo if script == "grpo" else bench_dpo
            module.build_parser().parse_args(options.split())


def test_flop_count_by_hand():
    shape = {"body": 10, "head": 3, "attn": 2}
    # 2 rows of 4 prompt + 2 completion tokens: 2 * (2*10*6 + 2*3*2 + 2*2*36)
    assert workload.forward_flops(shape, 2, 4, 2) == 2 * (120 + 12 + 144)
    f = workload.grpo_flops(shape, prompts=1, G=2, prompt=4, completion=2, beta=0.1, num_iterations=2)
    assert f["backward"] == 2 * f["forward"] and f["reference"] == f["forward"]  # (ref + old) / 2 iterations
    assert workload.digit_fraction(["p"], ["a1b2", ""]) == [0.5, 0.0]
