"""GRPO speed: preftune vs TRL's GRPOTrainer on the same work, in one run; prints s/step and ratios.

Same work for both: the embedded model (examples/model), the train prompts of the a+b task,
P prompts x G completions per step (one generation batch per optimiser step, one forward/backward
for all P*G completions), at most L new tokens, temperature 1.0, AdamW lr 3e-4 constant,
beta 0 (no reference model), loss_type dapo, 0/1 `accuracy` reward against the `answer` column
(preftune's builtin; TRL is handed the very same function, which follows TRL's reward contract).

Timed: one optimiser step = generation + reward + forward/backward + optimiser step, the first
`--warmup` steps excluded. preftune's `step_time` comes from OUTPUT_DIR/metrics.jsonl; TRL's is
taken by a TrainerCallback between on_step_begin and on_step_end. By default each framework runs
in its own fresh subprocess (default torch threads), one after the other. From the repo root:

    .venv/bin/python bench/bench_grpo.py [--steps 50] [--eval] [--json out.json]

This file also holds the small harness bench_dpo.py reuses (summary, table, subprocess workers).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__:
    from bench import workload
else:  # run as a script: bench/ is on sys.path
    import workload

ROOT = workload.ROOT
EXAMPLES = workload.EXAMPLES
FRAMEWORKS = ("preftune", "trl")

# ---------------------------------------------------------------------------------------------
# harness shared with bench_dpo.py


def max_prompt_length(args) -> int:
    """data.max_prompt_length of every workload: the shared prefix and 64 tokens for the task
    prompt."""
    return args.prompt_prefix + 64


def summarize(step_times: list[float], warmup: int) -> dict:
    """Median/mean seconds per step over the steps after `warmup`; steps/s = timed steps / their
    total time."""
    timed = step_times[warmup:]
    if not timed:
        raise ValueError(f"no timed steps: {len(step_times)} steps, {warmup} warmup")
    return {"timed_steps": len(timed), "median_s": statistics.median(timed),
            "mean_s": statistics.fmean(timed),
            "steps_per_s": len(timed) / sum(timed), "step_times": timed}


def first_last(values: list[float], k: int = 10) -> str:
    """'first -> last': means of the first and last k values (k shrinks to half the run when
    short)."""
    values = [v for v in values if v is not None]
    if not values:
        return "n/a"
    k = max(1, min(k, len(values) // 2))
    return f"{statistics.fmean(values[:k]):.3f} -> {statistics.fmean(values[-k:]):.3f}"


def read_metrics(out_dir: str | Path) -> list[dict]:
    """preftune's OUTPUT_DIR/metrics.jsonl: one record per logged step (eval records have no
    step_time)."""
    lines = (Path(out_dir) / "metrics.jsonl").read_text().splitlines()
    return [r for r in (json.loads(line) for line in lines if line.strip()) if "step_time" in r]


def step_timer():
    """A TRL/transformers TrainerCallback recording wall seconds between on_step_begin and
    on_step_end.

    Trainer calls on_step_begin before training_step (which, for GRPO, generates and scores the
    batch) and on_step_end after the optimiser step and zero_grad, before logging/saving."""
    from transformers import TrainerCallback

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times: list[float] = []
            self._t0 = 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self._t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.times.append(time.perf_counter() - self._t0)

    return StepTimer()


def versions() -> dict:
    import torch

    import preftune

    info = {"torch": torch.__version__, "threads": torch.get_num_threads(),
            "preftune": getattr(preftune, "__version__", "dev"),
            "device": "cuda" if torch.cuda.is_available() else "cpu"}
    try:
        import trl

        info["trl"] = trl.__version__
    except ImportError:
        info["trl"] = "not installed"
    return info


def child_argv(args: argparse.Namespace, framework: str, out_json: str) -> list[str]:
    """The command line that reruns this bench for one framework; every option's dest is its
    flag."""
    argv = ["--only", framework, "--json", out_json, "--worker"]
    for key, value in vars(args).items():
        if key in ("only", "json", "in_process", "worker"):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv += [flag] if value else []
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def run_frameworks(script: str, args: argparse.Namespace, runners: dict) -> dict:
    """{framework: result}. Each framework in a fresh subprocess (no shared warm state, no import
    side effects between them) unless --in-process; --only runs just one, here."""
    names = [args.only] if args.only else list(FRAMEWORKS)
    results = {}
    for name in names:
        load = os.getloadavg()[0]  # the machine is shared: keep the load each side started under
        if args.only or args.in_process:
            workload.reset_peak_cuda()
            results[name] = runners[name](args)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "result.json")
                subprocess.run([sys.executable, script,
                                *child_argv(args, name, out)], check=True, cwd=ROOT)
                results[name] = json.loads(Path(out).read_text())["results"][name]
        results[name]["load_avg_at_start"] = load
    return results


def report(title: str, args: argparse.Namespace, results: dict, load_before: float) -> dict:
    """Print the table (one row per framework, then the TRL/preftune ratio) and return the
    record."""
    info = versions()
    record = {
        "bench": title,
        "settings": {k: v for k, v in vars(args).items() if k not in ("json", "only", "worker")},
        "machine": info
        | {
            "cpus": os.cpu_count(),
            "load_avg_before": load_before,
            "load_avg_after": os.getloadavg()[0],
        },
        "results": results,
    }
    if args.worker:  # the parent prints the table
        Path(args.json).write_text(json.dumps(record))
        return record
    extra_cols = list(next(iter(results.values())).get("extra", {}))
    head = f"{'':<16}{'median s/step':>14}{'mean s/step':>13}{'steps/s':>9}" + "".join(
        f"  {c}" for c in extra_cols
    )
    print(f"\n{title}")
    print(f"torch {info['torch']} on {info['device']}, {info['threads']} "
          f"threads, {os.cpu_count()} CPUs; load avg {load_before:.2f} "
          f"before, {record['machine']['load_avg_after']:.2f} after")
    print(head)
    for name, r in results.items():
        label = f"{name} {info.get(name, '')}".strip()
        row = f"{label:<16}{r['median_s']:>14.4f}{r['mean_s']:>13.4f}{r['steps_per_s']:>9.2f}"
        print(row + "".join(f"  {r['extra'][c]:<{len(c)}}" for c in extra_cols))
    if {"preftune", "trl"} <= set(results):
        p, t = results["preftune"], results["trl"]
        record["ratio_trl_over_preftune"] = {"median": t["median_s"] / p["median_s"],
                                             "mean": t["mean_s"] / p["mean_s"]}
        ratio = record["ratio_trl_over_preftune"]
        print(f"{'TRL / preftune':<16}{ratio['median']:>13.2f}x{ratio['mean']:>12.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=1))
    return record


def common_args(ap: argparse.ArgumentParser, steps: int) -> None:
    ap.add_argument("--steps", type=int, default=steps, help="optimiser steps per framework")
    ap.add_argument("--warmup", type=int, default=3, help="first steps left out of the timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", choices=FRAMEWORKS,
                    help="run one framework only (also the subprocess worker)")
    ap.add_argument("--in-process", action="store_true",
                    help="run both in this process, one after the other")
    ap.add_argument("--json", help="write the numbers (and settings, versions, load) to this file")
    # a subprocess: JSON only
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)


def check_args(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.warmup < 0 or args.steps <= args.warmup:
        ap.error(f"--steps ({args.steps}) must exceed --warmup ({args.warmup})")


def quiet_hf() -> None:
    """Progress bars, info logs and deprecation warnings of the HF stack would bury the table."""
    import warnings

    os.environ.setdefault("TQDM_DISABLE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    try:
        import datasets

        datasets.disable_progress_bars()
    except ImportError:
        pass


def quiet_trainer(trainer) -> None:
    """With disable_tqdm, Trainer prints every log dict; drop that printer."""
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)


# ---------------------------------------------------------------------------------------------
# GRPO


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def greedy_accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int) -> float:
    """Mean `accuracy` reward of greedy completions on held-out rows: HF generate for a Hugging Face
    module (TRL's), preftune's sampler for its own module (greedy: the same tokens either way)."""
    import torch

    from preftune.model.load import base_module
    from preftune.rewards.builtin import accuracy
    from preftune.rollout.sampler import sample

    side, tokenizer.padding_side = tokenizer.padding_side, "left"
    device = next(model.parameters()).device
    enc = tokenizer([r["input"] for r in rows], return_tensors="pt", padding=True).to(device)
    tokenizer.padding_side = side
    was_training = model.training
    model.eval()
    with torch.no_grad():
        if hasattr(base_module(model), "generate"):
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
            new = out[:, enc["input_ids"].shape[1]:]  # (B, T)
        else:
            new = sample(model, enc["input_ids"], enc["attention_mask"], num_generations=1,
                         max_new_tokens=max_new_tokens, eos_id=tokenizer.eos_token_id,
                         pad_id=tokenizer.pad_token_id, greedy=True).completion_ids  # (B, T)
    model.train(was_training)
    texts = tokenizer.batch_decode(new, skip_special_tokens=True)
    rewards = accuracy([r["input"] for r in rows], texts, answer=[r["answer"] for r in rows])
    return sum(rewards) / len(rewards)


def grpo_overrides(args, out_dir: str, model: Path, train: str) -> list[str]:
    return [
        f"output_dir={out_dir}",
        f"max_steps={args.steps}",
        "save_steps=0",
        f"seed={args.seed}",
        *dtype_overrides(args),
        f"model.name_or_path={model}",
        f"data.train={train}",
        f"data.max_prompt_length={max_prompt_length(args)}",
        "data.eval=null",
        "log.progress_bar=false",
        "log.logging_steps=1",
        f"grpo.prompts_per_step={args.prompts}",
        f"grpo.num_generations={args.generations}",
        f"grpo.micro_batch_size={args.prompts * args.generations}",
        f"grpo.max_completion_length={args.max_new_tokens}",
        "grpo.temperature=1.0",
        f"grpo.reward_funcs=[{reward_spec(args)}]",
        "grpo.loss_type=dapo",
        f"grpo.beta={args.beta}",
        f"grpo.num_iterations={args.num_iterations}",
        f"optim.lr={args.lr}",
        "optim.lr_scheduler=constant",
        *(
            ["grpo.use_vllm=true", f"grpo.vllm_gpu_memory_utilization={args.vllm_gpu_memory}"]
            if args.vllm
            else []
        ),
    ]


def dtype_overrides(args) -> list[str]:
    """--bf16: preftune's mixed precision, float32 master weights with bf16 autocast (TRL's
    bf16=True)."""
    return ["model.dtype=bfloat16"] if args.bf16 else []


def reward_spec(args) -> str:
    return (
        "accuracy"
        if args.reward == "accuracy"
        else f"{ROOT / 'bench' / 'workload.py'}:digit_fraction"
    )


def reward_func(args):
    from preftune.rewards.builtin import accuracy

    return accuracy if args.reward == "accuracy" else workload.digit_fraction


def train_rows(args, tmp: str) -> tuple[str, list[dict]]:
    """The prompts file preftune reads and the same rows for TRL (long shared prefix when asked)."""
    rows = workload.prompt_rows(args.prompt_prefix)
    path = Path(tmp) / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path), rows


def mean_prompt_tokens(model: Path, prefix: int) -> float:
    """Mean tokens of the first 64 train prompts after a `prefix`-token shared text."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    return statistics.fmean(
        len(tok(r["input"]).input_ids) for r in workload.prompt_rows(prefix)[:64]
    )


def grpo_work(args, model: Path, completion: float) -> dict:
    """Nominal FLOPs per step by phase for these settings (see bench/workload.py)."""
    prompt = mean_prompt_tokens(model, args.prompt_prefix)
    return workload.grpo_flops(workload.model_shape(model), prompts=args.prompts,
                               G=args.generations, prompt=prompt,
                               completion=completion, beta=args.beta,
                               num_iterations=args.num_iterations)


def precision(model, autocast: bool) -> dict:
    """What a framework trained: its weights' dtype and device, and the autocast dtype (None:
    none)."""
    p = next(model.parameters())
    return {"params": str(p.dtype).removeprefix("torch."),
            "autocast": "bfloat16" if autocast else None, "device": p.device.type}


def finish(result: dict, timer, flops: dict, tokens_per_step: float, steps: int) -> dict:
    """Throughput columns: completion tokens trained per second, nominal FLOPs per step and by
    phase, achieved FLOP/s by phase (over all steps, nominal FLOPs / time in the phase), peak RSS
    and, on CUDA, peak GPU memory (setup included: model load, the DPO reference pass)."""
    result["completion_tokens_per_s"] = tokens_per_step / result["median_s"]
    result["flops_per_step"] = sum(flops.values())
    result["phase_s"] = dict(timer.seconds)
    result["phase_gflops"] = {k: steps * flops[k] / timer.seconds[k] / 1e9 for k in flops
                              if timer.seconds.get(k) and flops[k]}
    result["peak_rss_mb"] = workload.peak_rss_mb()
    result["peak_cuda_gib"] = workload.peak_cuda_gib()
    return result


def run_preftune_grpo(args) -> dict:
    import preftune.rollout.engine as engine  # the own sampler behind the engine interface
    import preftune.algorithms.grpo as grpo
    from preftune.config import load_config
    from preftune.model.load import compute_dtype
    from preftune.distributed.group import Parallel
    from preftune.run.loop import Run

    evals = read_jsonl(EXAMPLES / "data" / "eval_prompts.jsonl")
    timer = workload.PhaseTimer()
    with tempfile.TemporaryDirectory() as out:
        model = workload.model_dir(args.model, args.model_cache or out)
        train, _ = train_rows(args, out)
        cfg = load_config(EXAMPLES / "grpo.yaml",
                          grpo_overrides(args, os.path.join(out, "run"), model, train))
        run = Run(cfg, Parallel())
        before = (
            greedy_accuracy(run.model, run.tokenizer, evals, args.max_new_tokens)
            if args.eval
            else None
        )
        timer.wrap(engine, "sample", "sampling")
        if args.vllm:
            from preftune.rollout.vllm import VLLMEngine

            timer.wrap(VLLMEngine, "generate", "sampling")
        timer.wrap(grpo, "completion_logps")
        timer.wrap_backward()
        t0 = time.perf_counter()
        run.run()
        wall = time.perf_counter() - t0
        records = read_metrics(os.path.join(out, "run"))
        completion = statistics.fmean(r["completions/mean_length"] for r in records)
        flops = grpo_work(args, model, completion)
    result = summarize([r["step_time"] for r in records], args.warmup) | {"wall_s": wall}
    result["extra"] = {"train reward first->last": first_last([r.get("reward") for r in records])}
    result["rows_skipped_per_step"] = statistics.fmean(r.get("rows_skipped", 0.0) for r in records)
    result["precision"] = precision(run.model, compute_dtype(run.model) is not None)
    if args.vllm:
        result["push_s"] = statistics.median(r["vllm/weight_push_s"] for r in records[args.warmup:])
    if args.eval:
        after = greedy_accuracy(run.model, run.tokenizer, evals, args.max_new_tokens)
        result["extra"]["eval acc before->after"] = f"{before:.2f} -> {after:.2f}"
    return finish(result, timer, flops, args.prompts * args.generations * completion, len(records))


def run_trl_grpo(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    evals = read_jsonl(EXAMPLES / "data" / "eval_prompts.jsonl")
    timer = workload.PhaseTimer()
    with tempfile.TemporaryDirectory() as out:
        model_path = workload.model_dir(args.model, args.model_cache or out)
        _, train = train_rows(args, out)
        tok = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        before = greedy_accuracy(model, tok, evals, args.max_new_tokens) if args.eval else None
        ds = Dataset.from_list([{"prompt": r["input"], "answer": r["answer"]} for r in train])
        batch = args.prompts * args.generations  # TRL counts completions, not prompts
        step_times = step_timer()
        cfg = GRPOConfig(
            output_dir=os.path.join(out, "run"), max_steps=args.steps,
            per_device_train_batch_size=batch,
            generation_batch_size=batch, num_generations=args.generations,
            max_completion_length=args.max_new_tokens,
            temperature=1.0, learning_rate=args.lr, lr_scheduler_type="constant",
            warmup_steps=0, beta=args.beta,
            num_iterations=args.num_iterations, loss_type="dapo", max_grad_norm=1.0,
            gradient_checkpointing=False,
            use_cpu=not torch.cuda.is_available(), bf16=args.bf16,
            report_to="none", save_strategy="no",
            logging_steps=1, seed=args.seed, dataloader_num_workers=0,
            disable_tqdm=True, **trl_vllm(args))
        trainer = GRPOTrainer(model=model, reward_funcs=reward_func(args),
                              args=cfg, train_dataset=ds,
                              processing_class=tok, callbacks=[step_times])
        quiet_trainer(trainer)
        timer.wrap(trainer, "_generate", "sampling")
        timer.wrap(trainer, "_get_per_token_logps_and_entropies")
        timer.wrap_backward()
        pushes = time_calls(trainer.vllm_generation, "sync_weights") if args.vllm else []
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
        logs = [h for h in trainer.state.log_history if "reward" in h]
        completion = statistics.fmean(h["completions/mean_length"] for h in logs)
        flops = grpo_work(args, model_path, completion)
    result = summarize(step_times.times, args.warmup) | {"wall_s": wall}
    result["extra"] = {"train reward first->last": first_last([h["reward"] for h in logs])}
    result["precision"] = precision(trainer.model, trainer.accelerator.mixed_precision == "bf16")
    if args.vllm:
        result["push_s"] = statistics.median(pushes[args.warmup:])
    if args.eval:
        after = greedy_accuracy(trainer.model, tok, evals, args.max_new_tokens)
        result["extra"]["eval acc before->after"] = f"{before:.2f} -> {after:.2f}"
    return finish(result, timer, flops,
                  args.prompts * args.generations * completion, len(step_times.times))


def trl_vllm(args) -> dict:
    """TRL's colocate mode on the same terms as preftune's engine: the GPU share, the context
    length."""
    if not args.vllm:
        return {}
    return dict(use_vllm=True, vllm_mode="colocate",
                vllm_gpu_memory_utilization=args.vllm_gpu_memory,
                vllm_max_model_length=max_prompt_length(args) + args.max_new_tokens)


def time_calls(owner, attr: str) -> list[float]:
    """Seconds of each call of owner.attr, appended to the list returned (the phase timer skips
    calls nested in a timed phase, and a weight sync runs inside generation)."""
    fn, seconds = getattr(owner, attr), []

    def timed(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            seconds.append(time.perf_counter() - t0)

    setattr(owner, attr, timed)
    return seconds


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap, steps=50)
    ap.add_argument("--prompts", type=int, default=16, help="prompts per step")
    ap.add_argument("--generations", type=int, default=16, help="completions per prompt (G)")
    ap.add_argument("--max-new-tokens", type=int, default=4)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--eval", action="store_true",
                    help="also held-out greedy accuracy before and after")
    ap.add_argument("--beta", type=float, default=0.0,
                    help="KL coefficient (> 0 runs a reference model)")
    ap.add_argument("--num-iterations", type=int, default=1,
                    help="optimiser steps per generation batch")
    ap.add_argument("--reward", choices=("accuracy", "digits"), default="accuracy",
                    help="accuracy vs the answer, or the dense "
                    "digit fraction (for random-init models)")
    ap.add_argument("--vllm", action="store_true",
                    help="both sample with vLLM beside training (preftune "
                    "grpo.use_vllm, TRL vllm_mode=colocate)")
    ap.add_argument("--vllm-gpu-memory", type=float, default=0.3,
                    help="the engine's share of GPU memory")
    model_args(ap)
    return ap


def model_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="demo",
                    help="demo (examples/model), a generated model "
                    "(rand3m, rand3m-v32k, rand0.5b) or a path")
    ap.add_argument("--model-cache", help="folder for generated models (default: a temporary one)")
    ap.add_argument("--prompt-prefix", type=int, default=0,
                    help="tokens of shared text before each prompt")
    ap.add_argument("--bf16", action="store_true",
                    help="float32 weights under bf16 autocast (preftune "
                    "model.dtype=bfloat16, TRL bf16=True)")


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    quiet_hf()
    load_before = os.getloadavg()[0]
    results = run_frameworks(__file__, args, {"preftune": run_preftune_grpo, "trl": run_trl_grpo})
    title = (f"GRPO: {args.steps} steps ({args.warmup} warmup untimed), {args.prompts} prompts x "
             f"{args.generations} completions, {args.max_new_tokens} new tokens, lr {args.lr:g}, "
             f"beta {args.beta:g}, "
             f"dapo, num_iterations {args.num_iterations}, model {args.model}, prompt prefix "
             f"{args.prompt_prefix}"
             f"{', bf16 autocast' if args.bf16 else ''}{', vLLM colocate' if args.vllm else ''}")
    return report(title, args, results, load_before)


if __name__ == "__main__":
    main()
