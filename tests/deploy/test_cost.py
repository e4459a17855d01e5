"""`preftune cost`: the seed's example to the dollar, ranges, prices, and hours from throughput."""
from __future__ import annotations

import json

import pytest

from preftune.cli import command as cli
from preftune.deploy import cost
from preftune.errors import UserError
from tests.conftest import EXAMPLES, write_jsonl

SEED = ["cost", "--nodes", "3", "--gpus-per-node", "8", "--price-per-gpu-hour", "10-15", "--hours", "4-6",
        "--fsx-usd", "50", "--s3-usd", "10", "--iterations-per-year", "24"]


def test_the_seed_example_json(capsys):
    assert cli.main([*SEED, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compute_usd"] == [960, 2160]
    assert report["total_usd"] == [1020, 2220]
    assert report["annual_usd"] == [24480, 53280]
    i = report["inputs"]
    assert (i["gpus"], i["hours"], i["price_per_gpu_hour"], i["fsx_usd"], i["s3_usd"]) == (24, [4, 6], [10, 15],
                                                                                          [50, 50], [10, 10])


def test_the_seed_example_text(capsys):
    assert cli.main(SEED) == 0
    out = capsys.readouterr().out
    assert "compute:        $960-2,160" in out
    assert "per iteration:  $1,020-2,220" in out
    assert "per year:       $24,480-53,280 (24 iterations)" in out


def test_price_comes_from_the_prices_file_and_can_be_overridden(tmp_path, capsys):
    assert cli.main(["cost", "--hours", "5", "--json"]) == 0  # the deploy defaults: 3 x 8 spot p5en at $10-15
    assert json.loads(capsys.readouterr().out)["compute_usd"] == [1200, 1800]
    prices = tmp_path / "prices.yaml"
    prices.write_text("gpu_hour_usd:\n  p5en.48xlarge: {spot: 4, on-demand: [7, 8]}\n"
                      "storage: {fsx_gb_month_usd: 0.5, s3_gb_month_usd: 0.1}\n")
    assert cli.main(["cost", "--hours", "2", "--prices", str(prices), "--capacity-type", "on-demand",
                     "--fsx-gb", "100", "--s3-gb", "10", "--storage-months", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["compute_usd"] == [24 * 2 * 7, 24 * 2 * 8]
    assert report["storage_usd"] == pytest.approx([100 + 2, 100 + 2])


def test_missing_price_is_exit_78_naming_the_file(capsys):
    assert cli.main(["cost", "--hours", "2", "--capacity-type", "on-demand"]) == 78
    err = capsys.readouterr().err
    assert "no on-demand price for p5en.48xlarge" in err and "prices.yaml" in err


@pytest.mark.parametrize("args, where", [
    (["--hours", "6-4"], "--hours"), (["--hours", "four"], "--hours"),
    (["--hours", "1", "--price-per-gpu-hour", "-3"], "--price-per-gpu-hour"),
    (["--hours", "1", "--nodes", "0"], "--nodes"), ([], "--hours"),
    (["--tokens-per-second-per-gpu", "100"], "CONFIG"),
])
def test_bad_flags_are_exit_78(capsys, args, where):
    assert cli.main(["cost", *args]) == 78
    assert where in capsys.readouterr().err


def test_hours_from_a_measured_throughput(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data: {train: s3://b/p}\nmax_steps: 100\n"
                   "grpo: {prompts_per_step: 32, num_generations: 8}\ndata_x: 1\n".replace("data_x: 1\n", ""))
    metrics = write_jsonl(tmp_path / "metrics.jsonl", [{"step": 0, "eval/reward": 0.3}, {"step": 1, "tokens_per_second": 1.0}]
                          + [{"step": s, "tokens_per_second": 1000.0 * (1 + s % 2)} for s in range(2, 12)])
    assert cost.measured_throughput(metrics) == (1000.0, 2000.0)  # the warm-up step is left out
    assert cost.measured_throughput(metrics, gpus_in_run=2) == (500.0, 1000.0)
    assert cli.main(["cost", str(cfg), "--metrics", str(metrics), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    tokens = 100 * 32 * 8 * (512 + 256)  # steps x sequences x the config's length limits
    assert report["inputs"]["hours_from"]["tokens"] == tokens
    assert report["inputs"]["hours"] == pytest.approx([tokens / (2000 * 24) / 3600, tokens / (1000 * 24) / 3600])


def test_workload_counts_the_data_for_epochs():
    from preftune.config import load_config

    grpo = load_config(EXAMPLES / "grpo.yaml")
    prompts = sum(1 for line in open(grpo.data.train) if line.strip())
    work = cost.workload(grpo, epochs=2)
    assert work.samples == prompts
    assert work.steps == -(-2 * prompts // grpo.grpo.prompts_per_step)
    dpo = load_config(EXAMPLES / "dpo.yaml")
    work = cost.workload(dpo, epochs=1, tokens_per_sequence=100)
    assert work.samples > 0 and work.sequences_per_step == 2 * dpo.dpo.batch_size and work.tokens_per_sequence == 100
    assert cost.workload(dpo, epochs=1, samples=10).steps == -(-10 // dpo.dpo.batch_size)
    kto = load_config(EXAMPLES / "kto.yaml")  # every labeled response, and its mismatched pair
    work = cost.workload(kto, epochs=1)
    assert work.samples == 1270 and work.sequences_per_step == 2 * kto.kto.batch_size
    assert work.steps == -(-1270 // kto.kto.batch_size) and work.tokens_per_sequence == kto.kto.max_length


def test_parse_range():
    assert cost.parse_range("10-15", "x") == (10, 15)
    assert cost.parse_range("2.5", "x") == (2.5, 2.5)
    assert cost.parse_range([1, 2], "x") == (1, 2)
    with pytest.raises(UserError, match="x: expected 0 <= min <= max"):
        cost.parse_range("5-1", "x")


def test_the_docs_show_what_the_seed_example_prints(capsys):
    from tests.conftest import ROOT

    page = (ROOT / "docs" / "kubernetes.md").read_text()
    block = page.split("$ preftune cost --nodes 3 --gpus-per-node 8", 1)[1].split("```", 1)[0]
    command, shown = block.split("\n", 1)
    assert cli.main(["cost", "--nodes", "3", "--gpus-per-node", "8", *command.split()]) == 0
    assert capsys.readouterr().out.strip() == shown.strip()


def test_uncountable_data_asks_for_samples(tmp_path, capsys):
    from tests.conftest import write_parquet

    pairs = write_parquet(tmp_path / "pairs.parquet", [{"prompt": "a", "chosen": "b", "rejected": "c"}])
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"algorithm: dpo\ndata: {{train: {pairs}}}\n")
    assert cli.main(["cost", str(cfg), "--tokens-per-second-per-gpu", "1000", "--epochs", "1"]) == 78
    assert "pass --samples N" in capsys.readouterr().err
    assert cli.main(["cost", str(cfg), "--tokens-per-second-per-gpu", "1000", "--epochs", "1", "--samples", "64",
                     "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["inputs"]["hours_from"]["steps"] == 4  # 64 pairs / 16 per step
