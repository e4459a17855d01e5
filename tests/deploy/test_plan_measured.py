"""The plan against measurement on this CPU: the planned peak host memory of one process within ±20%
of the measured one (VmHWM above the resident size once the libraries are imported) for random
Qwen2 models of three sizes (63, 212 and 380 MB of float32) and GRPO with and without a reference,
DPO and SFT, and the demo's GRPO batch on the embedded model, whose peak is mostly activations. Each
run is a fresh process with a fixed mmap threshold (bench_plan.LIVE_MEMORY), so the resident size
follows the live tensors and a run measures the same each time; bench/bench_plan.py prints them all."""
from __future__ import annotations

import pytest

from bench import bench_plan

RUNS = [("grpo-demo", "demo"), ("grpo", "s"), ("grpo", "m"), ("grpo", "l"), ("grpo-ref", "s"), ("dpo", "s"),
        ("sft", "s")]
TOLERANCE = 0.20


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("plan")
    models = {size: bench_plan.model_for(size, tmp) for size in {s for _, s in RUNS}}
    runs = [(case, models[size]) for case, size in RUNS]
    peaks = bench_plan.measure(runs, tmp / "work", ranks=1, timeout=1200)  # minutes on a busy 2-core machine
    return {run: (bench_plan.rank0_peak(bench_plan.planned(case, model)), got[0])
            for run, (case, model), got in zip(RUNS, runs, peaks)}


@pytest.mark.parametrize("run", RUNS, ids=lambda r: f"{r[0]}-{r[1]}")
def test_planned_peak_within_20_percent_of_measured(measured, run):
    plan, got = measured[run]
    assert abs(got - plan) <= TOLERANCE * plan, f"{run}: planned {plan:.3f} GB, measured {got:.3f} GB"


def test_a_reference_model_adds_what_the_plan_says(measured):
    """The reference's term, not only the total: GRPO with beta > 0 minus without, planned and measured."""
    (plan_ref, got_ref), (plan, got) = measured[("grpo-ref", "s")], measured[("grpo", "s")]
    assert abs((got_ref - got) - (plan_ref - plan)) <= TOLERANCE * plan


# Two FSDP2 ranks (gloo): each rank reads only its slices and writes its own files of final/, so
# both ranks' peaks are alike. SFT and DPO measure 1.29x their plan under 2 ranks (docs/plan.md);
# that gap is open and not held here.
RANKS2 = [("grpo", "s"), ("grpo-ref", "s")]


@pytest.mark.parametrize("run", RANKS2, ids=lambda r: f"{r[0]}-{r[1]}")
def test_two_ranks_planned_peak_within_20_percent_of_each_ranks_measured(tmp_path, run):
    case, size = run
    model = bench_plan.model_for(size, tmp_path)
    peaks = bench_plan.measure([(case, model)], tmp_path / "work", ranks=2, timeout=1200)[0]
    plan = bench_plan.rank0_peak(bench_plan.planned(case, model, ranks=2))
    assert all(abs(got - plan) <= TOLERANCE * plan for got in peaks), f"planned {plan:.3f} GB, measured {peaks}"
