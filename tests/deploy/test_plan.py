"""`preftune plan`: the terms' arithmetic by hand, the verdict, bad input (78), render refusing a job
that does not fit, and docs/plan.md's tables equal to the command's output."""
from __future__ import annotations

import json
import re
import struct
import subprocess
import sys

import pytest

from preftune.cli import command as cli
from preftune.config import load_config
from preftune.deploy import plan as planner
from preftune.deploy.nodes import INSTANCE_TYPES
from tests.conftest import ROOT

JOB32 = ROOT / "examples" / "jobs" / "grpo-32b.yaml"
JOB70 = ROOT / "examples" / "jobs" / "grpo-70b.yaml"


def run(capsys, *args) -> tuple[int, str, str]:
    code = cli.main(list(map(str, args)))
    out = capsys.readouterr()
    return code, out.out, out.err


def _terms(plan: dict, phase: str) -> dict[str, float]:
    return {t["name"]: t["gb"] for p in plan["phases"] if p["name"] == phase for t in p["terms"]}


def test_parameter_count_equals_the_examples_weights():
    """Shape.params counts what the safetensors file holds (its header: shapes only)."""
    f = (ROOT / "examples" / "model" / "model.safetensors").read_bytes()
    header = json.loads(f[8:8 + struct.unpack("<Q", f[:8])[0]])
    stored = sum(__import__("math").prod(v["shape"]) for k, v in header.items() if k != "__metadata__")
    assert planner.read_shape(str(ROOT / "examples" / "model")).params == stored


def test_the_32b_job_term_by_term():
    """The seed's job against docs/distributed.md's arithmetic: P = 32.76e9, 24 ranks, bf16 over fp32."""
    cfg = load_config(JOB32)
    shape = planner.read_shape(cfg.model.name_or_path)
    P = shape.params
    assert P == 64 * (2 * 5120 * 5120 + 2 * 5120 * 1024 + 3 * 5120 * 27648 + 5120 + 2 * 1024 + 2 * 5120) \
        + 2 * 152064 * 5120 + 5120
    target = planner.Target("p5en.48xlarge", 3, 8, INSTANCE_TYPES["p5en.48xlarge"], 2048 * 2 ** 30 / 1e9)
    plan = planner.make_plan(cfg, shape, target)
    train, gen = _terms(plan, "train"), _terms(plan, "generate")
    assert train["parameters"] == pytest.approx(P * 4 / 24 / 1e9, abs=1e-6)
    assert train["gradients"] == pytest.approx(P * 4 / 24 / 1e9, abs=1e-6)
    assert train["AdamW moments"] == pytest.approx(P * 8 / 24 / 1e9, abs=1e-6)
    assert gen["whole model gathered"] == pytest.approx(P * 2 / 1e9, abs=1e-6)
    # 512 sequences over 24 ranks: 22 on the first; K and V of 64 layers x 8 heads x 128, bf16
    assert gen["KV cache"] == pytest.approx(22 * 1536 * 2 * 64 * 8 * 128 * 2 / 1e9, abs=1e-6)
    # a micro-batch of 2 completions of one group: its 512-token prompt laid out once, 2 x 1024 after it
    tokens = 512 + 2 * 1024
    assert train["activations, checkpointed (block inputs)"] == pytest.approx(tokens * 5120 * 4 * 64 / 1e9, abs=1e-6)
    assert "gradients" not in gen  # set to None after each optimizer step
    g = plan["gpu"]
    assert g["peak_phase"] == "generate"
    assert g["peak_gb"] == pytest.approx(sum(gen.values()) + planner.CUDA_RESERVE_GB, abs=1e-3)
    assert g["headroom_gb"] == pytest.approx(141 - g["peak_gb"], abs=1e-3)
    # no process holds the whole model: each rank reads its rows of one tensor at a time (the
    # embedding the largest, cut over 24 ranks, bf16 as stored and fp32 as held), and final/ gathers
    # one tensor at a time, cast to bf16 on the device, copied to the host for its file
    load, final = _terms(plan, "load"), _terms(plan, "final")
    assert load["weights: largest tensor's slice read"] == pytest.approx(6336 * 5120 * (2 + 4) / 1e9, abs=1e-6)
    assert final["largest tensor gathered"] == pytest.approx(152064 * 5120 * 4 / 1e9, abs=1e-6)
    assert final["its cast to bfloat16"] == final["it in bfloat16, to its file"] == pytest.approx(
        152064 * 5120 * 2 / 1e9, abs=1e-6)
    assert not any(t["rank0"] for p in plan["phases"] for t in p["terms"])
    assert plan["host"]["peak_gb"] < 40 and plan["host"]["peak_phase"] == "final"
    # cost: hours from the step time, priced by deploy/cost.py at the shipped $10-15 per GPU-hour
    hours = plan["time"]["step_s"] * 200 / 3600
    assert plan["cost"]["compute_usd"] == pytest.approx([24 * hours * 10, 24 * hours * 15], rel=1e-3)


def test_under_lora_each_rank_builds_the_base_and_final_is_merged_tensor_by_tensor():
    """LoRA under FSDP2: PEFT wraps the whole module before it is sharded, so every rank fills the
    whole base one tensor at a time; final/ merges each adapted projection as it is gathered (no
    merged copy of the model, nothing on rank 0 alone)."""
    cfg = load_config(JOB32, ["model.lora.enabled=true"])
    shape = planner.read_shape(cfg.model.name_or_path)
    target = planner.Target("p5en.48xlarge", 3, 8, INSTANCE_TYPES["p5en.48xlarge"], 2000)
    plan = planner.make_plan(cfg, shape, target)
    load, final = _terms(plan, "load"), _terms(plan, "final")
    assert load["model being built"] == pytest.approx(shape.params * 2 / 1e9, abs=1e-6)
    assert load["weights: largest tensor read"] == pytest.approx(152064 * 5120 * (2 + 2) / 1e9, abs=1e-6)
    assert "weights as stored (read)" not in load and "merged copy" not in final
    assert final["largest tensor gathered"] == pytest.approx(152064 * 5120 * 2 / 1e9, abs=1e-6)
    assert not any(t["rank0"] for p in plan["phases"] for t in p["terms"])


def test_sharding_divides_the_state_and_one_process_holds_it_whole():
    cfg = load_config(JOB32, ["model.lora.enabled=false"])
    shape = planner.read_shape(cfg.model.name_or_path)
    node = INSTANCE_TYPES["p5en.48xlarge"]
    one = planner.make_plan(cfg, shape, planner.Target("p5en.48xlarge", 1, 1, node, 2000))
    many = planner.make_plan(cfg, shape, planner.Target("p5en.48xlarge", 3, 8, node, 2000))
    assert _terms(one, "train")["AdamW moments"] == pytest.approx(24 * _terms(many, "train")["AdamW moments"])
    assert "gathered block + prefetch" not in _terms(one, "train")
    assert one["verdict"] == "does not fit"  # 16 B x 32.8e9 on one GPU


def test_checkpointing_and_lora_shrink_the_training_phase():
    cfg = load_config(JOB32, ["model.gradient_checkpointing=false"])
    shape = planner.read_shape(cfg.model.name_or_path)
    target = planner.Target("p5en.48xlarge", 3, 8, INSTANCE_TYPES["p5en.48xlarge"], 2000)
    full = planner.make_plan(cfg, shape, target)["gpu"]["per_phase_gb"]["train"]
    ckpt = planner.make_plan(load_config(JOB32), shape, target)["gpu"]["per_phase_gb"]["train"]
    lora = planner.make_plan(load_config(JOB32, ["model.lora.enabled=true"]), shape, target)
    assert ckpt < full
    assert _terms(lora, "train")["LoRA adapter"] < 1 and "AdamW moments" in _terms(lora, "train")
    assert lora["gpu"]["per_phase_gb"]["train"] < ckpt


def test_vllm_sleep_mode_hands_the_engine_back_for_training():
    shape = planner.read_shape(str(JOB70.parent / "llama-3.1-70b"))
    target = planner.Target("p5en.48xlarge", 3, 8, INSTANCE_TYPES["p5en.48xlarge"], 2000)
    awake = planner.make_plan(load_config(JOB70, ["grpo.vllm_enable_sleep_mode=false"]), shape, target)
    asleep = planner.make_plan(load_config(JOB70), shape, target)
    engine = _terms(awake, "train")["vLLM engine (awake)"]
    assert engine == pytest.approx(0.5 * 141)
    assert awake["gpu"]["per_phase_gb"]["train"] - asleep["gpu"]["per_phase_gb"]["train"] == pytest.approx(engine)
    assert asleep["vllm"]["handed_back_gb"] == pytest.approx(engine) and awake["vllm"]["handed_back_gb"] == 0
    gen = _terms(asleep, "generate")  # weights at TP 4 and the KV cache fill the engine's share
    assert gen["vLLM engine weights"] == pytest.approx(shape.params * 2 / 4 / 1e9, abs=1e-3)
    assert gen["vLLM engine weights"] + gen["vLLM KV cache"] == pytest.approx(engine, abs=1e-3)
    whole = planner.make_plan(load_config(JOB70, ["grpo.vllm_tensor_parallel_size=1"]), shape, target)
    assert whole["vllm"]["kv_cache_gb"] < 0 and whole["verdict"] == "does not fit"  # 141 GB of weights in 70.5


def test_plan_prints_and_json(capsys):
    code, out, _ = run(capsys, "plan", JOB32)
    assert code == 0 and "per GPU, GB" in out and "per host, GB" in out and "cost per iteration: $" in out
    code, out, _ = run(capsys, "plan", JOB32, "--json")
    plan = json.loads(out)
    assert code == 0 and plan["verdict"] in ("fits", "tight") and plan["host"]["pod_memory"].endswith("Gi")


@pytest.mark.parametrize("args, where", [
    (["deploy.instance_types=[p9.huge]"], "deploy.instance_types: unknown node type 'p9.huge'"),
    (["data.max_prompt_length=32000"], "grpo.max_completion_length: 33024 tokens per sequence exceed"),
    (["--model-config", ROOT / "docs"], "--model-config: "),
    (["--mfu", "1.5"], "--mfu: must be in"),
    (["deploy.gpus_per_node=16"], "deploy.gpus_per_node: 16 GPUs per node"),
])
def test_bad_input_is_78_in_one_line(capsys, args, where):
    code, out, err = run(capsys, "plan", JOB32, *args)
    assert code == 78 and out == ""
    assert err.count("\n") == 1 and where in err, err


def test_a_model_folder_without_config_json_is_78(capsys, tmp_path):
    code, _, err = run(capsys, "plan", JOB32, f"model.name_or_path={tmp_path}")
    assert code == 78 and f"{tmp_path} has no config.json" in err and err.count("\n") == 1


def test_render_refuses_a_job_that_does_not_fit_unless_forced(capsys, tmp_path):
    code, out, err = run(capsys, "render", JOB70, "grpo.use_vllm=false", "-o", tmp_path / "k8s")
    assert code == 78 and not (tmp_path / "k8s").exists()
    assert "does not fit its node type" in err and "whole model gathered" in err and "verdict: does not fit" in err
    code, out, _ = run(capsys, "render", JOB70, "grpo.use_vllm=false", "-o", tmp_path / "k8s", "--force")
    assert code == 0 and "plan: does not fit" in out


def test_the_pods_memory_request_comes_from_the_plan(capsys, tmp_path):
    import yaml

    code, out, _ = run(capsys, "plan", JOB32, "--json")
    want = json.loads(out)["host"]["pod_memory"]
    code, out, _ = run(capsys, "render", JOB32, "-o", tmp_path)
    assert code == 0
    job = yaml.safe_load((tmp_path / "7-job.yaml").read_text())
    for task in job["spec"]["tasks"]:
        resources = task["template"]["spec"]["containers"][0]["resources"]
        assert resources["requests"]["memory"] == resources["limits"]["memory"] == want


def test_render_without_a_local_model_keeps_deploy_memory(capsys, tmp_path):
    code, out, _ = run(capsys, "render", JOB32, "model.name_or_path=/models/qwen", "-o", tmp_path)
    assert code == 0 and "no memory plan" in out and "1600Gi" in (tmp_path / "7-job.yaml").read_text()


def test_the_docs_tables_are_the_commands_output(capsys, monkeypatch):
    """Every `$ preftune plan ...` block in docs/plan.md is what the command prints now."""
    monkeypatch.chdir(ROOT)
    text = (ROOT / "docs" / "plan.md").read_text()
    blocks = re.findall(r"```\n\$ preftune (plan [^\n]*)\n(.*?)```", text, flags=re.S)
    assert len(blocks) >= 3
    for command, shown in blocks:
        code, out, _ = run(capsys, *command.split())
        assert code == 0 and out == shown, f"docs/plan.md: rerun `preftune {command}`"


def test_the_plan_module_imports_no_torch():
    code = "import sys, preftune.deploy.plan; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT).stdout
    assert out.strip() == "False"


def test_the_plans_copies_of_model_facts_match_their_homes():
    """plan.py is torch-free, so it restates three facts of model/: they must stay equal."""
    from preftune.model import head, llama

    assert planner.CHUNK_ELEMENTS == head.CHUNK_ELEMENTS
    assert planner.PROJECTIONS == llama.PROJECTIONS
    assert planner.OWN_MODEL_TYPES == llama.ARCHITECTURES


def test_cpu_plan_is_per_process_against_this_machines_memory(capsys):
    code, out, _ = run(capsys, "plan", ROOT / "examples" / "grpo.yaml", "--cpu", "--nproc", "2", "--json")
    plan = json.loads(out)
    total = next(int(line.split()[1]) * 1024 / 1e9 for line in open("/proc/meminfo") if line.startswith("MemTotal"))
    assert code == 0 and "gpu" not in plan and "time" not in plan
    assert plan["process"]["capacity_gb"] == pytest.approx(total / 2, abs=1e-3)
    assert plan["job"]["ranks"] == 2 and plan["job"]["strategy"] == "fsdp"
    load = _terms(plan, "load")  # each rank its half of the embedding: float32 as stored and as held
    s = planner.read_shape(str(ROOT / "examples" / "model"))
    assert load["weights: largest tensor's slice read"] == pytest.approx(-(-s.vocab // 2) * s.hidden * 8 / 1e9, abs=1e-6)
    assert "weights as stored (read)" not in load


def test_cpu_offload_moves_the_sharded_state_from_the_gpu_to_each_ranks_host():
    """Parameters, gradients, AdamW moments (and the frozen reference) leave the GPU terms and join
    the host terms of every rank on the node (8 per p5en node); the load still fills shards on the
    GPU."""
    shape = planner.read_shape(load_config(JOB32).model.name_or_path)
    target = planner.Target("p5en.48xlarge", 3, 8, INSTANCE_TYPES["p5en.48xlarge"], 2000)
    base = ["model.lora.enabled=false", "grpo.beta=0.04"]  # a frozen reference model too
    on = planner.make_plan(load_config(JOB32, [*base, "distributed.cpu_offload=true"]), shape, target)
    off = planner.make_plan(load_config(JOB32, base), shape, target)
    P = shape.params
    moved = {"parameters": P * 4 / 24, "gradients": P * 4 / 24, "AdamW moments": P * 8 / 24,
             "reference model": P * 2 / 24}
    hosted = {t["name"]: t["gb"] for p in on["phases"] if p["name"] == "train" for t in p["terms"] if t["host"]}
    assert hosted == pytest.approx({k: v / 1e9 for k, v in moved.items()}, abs=1e-6)
    gb = sum(moved.values()) / 1e9
    assert off["gpu"]["per_phase_gb"]["train"] - on["gpu"]["per_phase_gb"]["train"] == pytest.approx(gb, abs=1e-3)
    assert on["host"]["per_phase_gb"]["train"] - off["host"]["per_phase_gb"]["train"] == pytest.approx(8 * gb, abs=1e-3)
    assert on["gpu"]["peak_gb"] < off["gpu"]["peak_gb"] and on["job"]["cpu_offload"]
    assert _terms(on, "load")["parameters"] == _terms(off, "load")["parameters"]  # filled on the GPU
    one = planner.make_plan(load_config(JOB32, [*base, "distributed.cpu_offload=true"]), shape,
                            planner.Target("p5en.48xlarge", 1, 1, INSTANCE_TYPES["p5en.48xlarge"], 2000))
    assert not one["job"]["cpu_offload"]  # one process: no FSDP2, nothing moves
