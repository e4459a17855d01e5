"""`preftune plan --cpu` against measurement: the planned peak host memory per process beside the
measured one (VmHWM above the resident size once the libraries are imported), for random Qwen2
models of three sizes built from examples/model/config.json, 1 process and 2 FSDP2 ranks (gloo).

    python bench/bench_plan.py                 # every case
    python bench/bench_plan.py --size s m      # some sizes
tests/deploy/test_plan_measured.py runs a few cases with a ±20% tolerance.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
# hidden, layers (intermediate 4 x hidden, 4 heads, 2 key/value heads, the examples' 259-token
# vocabulary)
SIZES = {"s": (512, 4), "m": (768, 6), "l": (1024, 6)}
CASES = {  # algorithm and overrides of each workload: two short steps, final/ written
    # examples/grpo.yaml's batch: 256 completions of 4 tokens in one micro-batch (activations
    # dominate)
    "grpo-demo": ["algorithm=grpo", "data.train=DATA/train_prompts.jsonl",
                  "grpo.prompts_per_step=16",
                  "grpo.num_generations=16", "grpo.micro_batch_size=256",
                  "grpo.max_completion_length=4", "data.max_prompt_length=16"],
    "grpo": ["algorithm=grpo", "data.train=DATA/train_prompts.jsonl", "grpo.prompts_per_step=4",
             "grpo.num_generations=4", "grpo.micro_batch_size=16", "grpo.max_completion_length=8",
             "data.max_prompt_length=16"],
    "grpo-ref": ["algorithm=grpo", "data.train=DATA/train_prompts.jsonl", "grpo.prompts_per_step=4",
                 "grpo.num_generations=4", "grpo.micro_batch_size=16",
                 "grpo.max_completion_length=8", "data.max_prompt_length=16", "grpo.beta=0.04"],
    "dpo": ["algorithm=dpo", "data.train=DATA/traces.parquet",
            "data.invalid=drop", "dpo.batch_size=4",
            "dpo.micro_batch_size=4", "dpo.max_length=32", "data.max_prompt_length=16"],
    "sft": ["algorithm=sft", "data.train=DATA/traces.parquet",
            "data.invalid=drop", "sft.min_reward=0.0",
            "sft.batch_size=8", "sft.micro_batch_size=8", "sft.max_length=32",
            "data.max_prompt_length=16"],
}
COMMON = ["max_steps=2", "save_steps=0", "log.progress_bar=false", "grpo.reward_funcs=[accuracy]",
          "optim.lr=1e-4", "seed=0"]

# Runs in each measured process: import what a run imports, make every mapped library page
# resident, note the resident size, reset the high-water mark (Linux: clear_refs 5), train, report
# the high-water mark above that start.
DRIVER = r"""
import ctypes, gc, json, os, sys
import torch, transformers, safetensors.torch
from transformers import AutoConfig, AutoTokenizer
from transformers.models.qwen2 import modeling_qwen2
import torch.distributed.fsdp, torch.distributed.checkpoint.state_dict, torch.distributed.tensor
import preftune.api, preftune.run.loop, preftune.rollout.sampler, preftune.algorithms.grpo
import preftune.algorithms.dpo, preftune.algorithms.sft, pyarrow.parquet, peft

def status(key):
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith(key + ":"))

MADV_POPULATE_READ = 22  # Linux 5.14

# Every page of the mapped files (mostly libtorch's code) made resident, so the kernels a run
# first calls add nothing above the start: the plan counts memory above the libraries, and which
# code pages a run touches depends on the CPU (about 20 MB of libtorch_cpu.so here).
def resident_libraries():
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) > 5 and fields[5].startswith("/") and fields[1].startswith("r"):
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if libc.madvise(lo, hi - lo, MADV_POPULATE_READ) != 0 and ".so" in fields[5]:
                for page in range(lo, hi, 4096):  # an older kernel: read a byte of each page
                    ctypes.string_at(page, 1)

# [[model folder, config, overrides], ...], one after the other
runs = json.loads(open(sys.argv[1]).read())
AutoTokenizer.from_pretrained(runs[0][0])
resident_libraries()
for model, config, overrides in runs:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # what the run before freed goes back first
    base = status("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    preftune.api.train(config, overrides=overrides)
    peak = status("VmHWM")
    rank = int(os.environ.get("RANK", 0))
    print("MEASURED " + json.dumps({"rank": rank, "above_gb": (peak - base) / 1e9}), flush=True)
os._exit(0)
"""


def model_for(size: str, tmp: Path) -> Path:
    """The embedded model for "demo", else a random one of SIZES[size]."""
    return EXAMPLES / "model" if size == "demo" else make_model(tmp / f"model-{size}", *SIZES[size])


def make_model(folder: Path, hidden: int, layers: int) -> Path:
    """A random Qwen2 of this size, saved as the examples' folder is (float32, tokenizer beside)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    from preftune.model.llama import Llama

    folder.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((EXAMPLES / "model" / "config.json").read_text())
    cfg.update(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
               layer_types=["full_attention"] * layers)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(EXAMPLES / "model" / name, folder / name)
    model = Llama.from_pretrained(folder, AutoConfig.from_pretrained(folder),
                                  dtype=torch.float32, weights=False)
    gen = torch.Generator().manual_seed(0)
    state = {k: (torch.randn(v.shape, generator=gen) * 0.02 if v.dim() > 1 else torch.ones(v.shape))
             for k, v in model.state_dict().items() if not (model.tied and k == "lm_head.weight")}
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


# A fixed mmap threshold: each block above 128 KiB is mapped when allocated and unmapped when freed,
# so the resident size follows the live tensors. Without it, the heap kept by
# run/host_memory.keep_freed_memory (freed blocks up to 32 MiB reused, not returned) makes the
# same run's peak vary by up to a quarter from run to run.
LIVE_MEMORY = {"MALLOC_MMAP_THRESHOLD_": str(128 << 10)}


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def overrides(case: str, model: Path, out: Path) -> list[str]:
    return [o.replace("DATA", str(EXAMPLES / "data")) for o in CASES[case]] + COMMON + [
        f"model.name_or_path={model}", f"output_dir={out}"]


def measure(runs: list[tuple[str, Path]], work: Path, ranks: int = 1,
            timeout: float = 600) -> list[list[float]]:
    """Measured peaks (GB above the start of each run) of `runs` ((case, model) pairs), each in
    fresh processes (one per rank), as a restarted run starts: one list per run, one value per
    rank."""
    if len(runs) > 1:
        return [measure([run], work / f"run-{i}", ranks, timeout)[0] for i, run in enumerate(runs)]
    work.mkdir(parents=True, exist_ok=True)
    (work / "driver.py").write_text(DRIVER)
    config = work / "job.yaml"
    config.write_text("{}\n")
    todo = [[str(model), str(config), overrides(case, model, work / f"run-{i}")]
            for i, (case, model) in enumerate(runs)]
    (work / "runs.json").write_text(json.dumps(todo))
    args = [sys.executable, str(work / "driver.py"), str(work / "runs.json")]
    port, procs = _port(), []
    for r in range(ranks):
        env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **LIVE_MEMORY)
        if ranks > 1:
            env.update(RANK=str(r), WORLD_SIZE=str(ranks), LOCAL_RANK=str(r),
                       LOCAL_WORLD_SIZE=str(ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen(args, stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, env=env, cwd=work))
    found: dict[int, list[float]] = {}
    for p in procs:
        out = p.communicate(timeout=timeout)[0]
        if p.returncode != 0:
            raise RuntimeError(f"exit {p.returncode}:\n{out[-3000:]}")
        for line in out.splitlines():
            if line.startswith("MEASURED "):
                rec = json.loads(line.removeprefix("MEASURED "))
                found.setdefault(rec["rank"], []).append(rec["above_gb"])
    for i in range(len(runs)):  # a run's final/ is as large as its model: not kept once measured
        shutil.rmtree(work / f"run-{i}", ignore_errors=True)
    return [[found[r][i] for r in range(ranks)] for i in range(len(runs))]


def planned(case: str, model: Path, ranks: int = 1) -> dict:
    """`preftune plan --cpu` of the same run (the plan's JSON)."""
    from preftune.config import load_config
    from preftune.deploy import plan as planner

    cfg = load_config({}, overrides(case, model, Path(tempfile.gettempdir()) / "unused"))
    target = planner.Target("cpu", 1, ranks, host_gb=1e3)
    return planner.make_plan(cfg, planner.read_shape(str(model)), target)


def rank0_peak(plan: dict) -> float:
    return plan["process"]["peak_gb"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", nargs="*", default=list(SIZES), choices=[*SIZES, "demo"])
    ap.add_argument("--case", nargs="*", default=list(CASES), choices=list(CASES))
    ap.add_argument("--ranks", nargs="*", type=int, default=[1, 2])
    args = ap.parse_args()
    print(f"{'size':5} {'case':9} {'ranks':>5} {'params':>8} "
          f"{'plan GB':>8} {'measured GB':>12} {'ratio':>6}  phase")
    with tempfile.TemporaryDirectory() as tmp:
        models = {size: model_for(size, Path(tmp)) for size in args.size}
        runs = [(case, models[size]) for size in args.size for case in args.case]
        for ranks in args.ranks:
            got = measure(runs, Path(tmp) / f"ranks-{ranks}", ranks)
            for (case, model), peaks in zip(runs, got):
                plan = planned(case, model, ranks)
                print(f"{model.name.removeprefix('model-'):5} {case:9} {ranks:>5} "
                      f"{plan['job']['params'] / 1e6:>7.1f}M {rank0_peak(plan):>8.3f} "
                      f"{peaks[0]:>12.3f} {peaks[0] / rank0_peak(plan):>6.2f}  "
                      f"{plan['process']['peak_phase']}", flush=True)


if __name__ == "__main__":
    main()
