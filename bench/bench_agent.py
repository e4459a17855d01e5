"""Multi-turn GRPO with a tool: preftune's tool loop vs TRL 1.16's `tools=` loop on the same work,
in one run; prints s/step and the ratio.

Same work for both: the agent demo's stage-1 model (examples/agent_sft.yaml, trained here once by
preftune with --sft-steps and handed to both), the agent prompts (examples/data/
agent_prompts.jsonl), P prompts x G rollouts per step; each rollout may call `add`
(examples/agent_tools.py) up to --iterations times within --max-new-tokens (tool tokens
included); temperature 1.0, AdamW lr constant, beta 0, loss_type dapo, preftune's builtin
`accuracy` reward (TRL's contract) on the last assistant turn. TRL parses the calls with its Qwen
response template (the agent model's template is Qwen-style).

Timed: one optimiser step = the rollouts with their tool rounds + rewards + forward/backward +
optimiser step, the first --warmup steps excluded. Sampled rollouts differ between the two, so the
table shows each side's work beside its time: tool calls per rollout and completion tokens per
rollout. From the repo root:

    .venv/bin/python bench/bench_agent.py [--steps 12] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__:
    from bench import workload
    from bench.bench_grpo import (common_args, check_args, first_last, quiet_hf, quiet_trainer,
                                  read_jsonl, read_metrics, report, run_frameworks, step_timer,
                                  summarize)
else:  # run as a script: bench/ is on sys.path
    import workload
    from bench_grpo import (common_args, check_args, first_last, quiet_hf, quiet_trainer,
                            read_jsonl, read_metrics, report, run_frameworks, step_timer,
                            summarize)

ROOT = workload.ROOT
EXAMPLES = workload.EXAMPLES
PROMPTS = EXAMPLES / "data" / "agent_prompts.jsonl"


def stage_one(args, cache: str) -> Path:
    """The agent demo's SFT model, trained once into `cache` (reused when it is there)."""
    out = Path(cache) / f"agent-sft-{args.sft_steps}"
    if not (out / "final").is_dir():
        subprocess.run([sys.executable, "-m", "preftune.cli", "train",
                        str(EXAMPLES / "agent_sft.yaml"), f"max_steps={args.sft_steps}",
                        f"output_dir={out}", "data.eval=null", "log.progress_bar=false",
                        "resume=never", "overwrite_output_dir=true"],
                       check=True, cwd=ROOT, stdout=subprocess.DEVNULL)
    return out / "final"


def add_tool():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from agent_tools import add
    finally:
        sys.path.remove(str(EXAMPLES))
    return add


def work(tokens: list[float], calls: list[float]) -> dict:
    return {"tokens per rollout": f"{statistics.fmean(tokens):.1f}",
            "calls per rollout": f"{statistics.fmean(calls):.2f}"}


def run_preftune(args) -> dict:
    from preftune.config import load_config
    from preftune.distributed.group import Parallel
    from preftune.run.loop import Run

    with tempfile.TemporaryDirectory() as out:
        cfg = load_config(EXAMPLES / "agent.yaml", [
            f"model.name_or_path={args.model}", f"output_dir={os.path.join(out, 'run')}",
            f"max_steps={args.steps}", "save_steps=0", "data.eval=null", f"seed={args.seed}",
            "log.progress_bar=false", f"grpo.prompts_per_step={args.prompts}",
            f"grpo.num_generations={args.generations}",
            f"grpo.micro_batch_size={args.prompts * args.generations}",
            f"grpo.max_completion_length={args.max_new_tokens}",
            f"grpo.max_tool_calling_iterations={args.iterations}", f"optim.lr={args.lr}",
            "optim.lr_scheduler=constant", "optim.warmup_steps=0"])
        t0 = time.perf_counter()
        Run(cfg, Parallel()).run()
        wall = time.perf_counter() - t0
        records = read_metrics(os.path.join(out, "run"))
    timed = records[args.warmup:]
    result = summarize([r["step_time"] for r in records], args.warmup) | {"wall_s": wall}
    result["extra"] = work([r["completions/mean_length"] for r in timed],
                           [r["tools/call_frequency"] for r in timed])
    result["extra"]["train reward first->last"] = first_last([r["reward"] for r in records])
    return result


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer
    from trl.chat_template_utils import qwen3_template

    from preftune.rewards.builtin import accuracy

    with tempfile.TemporaryDirectory() as out:
        tok = AutoTokenizer.from_pretrained(args.model)
        tok.response_template = qwen3_template  # how TRL reads calls in a Qwen-style template
        model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
        rows = read_jsonl(PROMPTS)
        ds = Dataset.from_list([{"prompt": r["input"], "answer": r["answer"]} for r in rows])
        batch = args.prompts * args.generations  # TRL counts completions, not prompts
        step_times = step_timer()
        cfg = GRPOConfig(
            output_dir=os.path.join(out, "run"), max_steps=args.steps,
            per_device_train_batch_size=batch, generation_batch_size=batch,
            num_generations=args.generations, max_completion_length=args.max_new_tokens,
            max_tool_calling_iterations=args.iterations, temperature=1.0,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, beta=0.0,
            loss_type="dapo", max_grad_norm=1.0, use_cpu=not torch.cuda.is_available(),
            report_to="none", save_strategy="no", logging_steps=1, seed=args.seed,
            dataloader_num_workers=0, disable_tqdm=True)
        trainer = GRPOTrainer(model=model, reward_funcs=accuracy, args=cfg, train_dataset=ds,
                              processing_class=tok, callbacks=[step_times], tools=[add_tool()])
        quiet_trainer(trainer)
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
        logs = [h for h in trainer.state.log_history if "reward" in h]
    timed = logs[args.warmup:]
    result = summarize(step_times.times, args.warmup) | {"wall_s": wall}
    result["extra"] = work([h["completions/mean_length"] for h in timed],
                           [h.get("tools/call_frequency", 0.0) for h in timed])
    result["extra"]["train reward first->last"] = first_last([h["reward"] for h in logs])
    return result


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap, steps=12)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--generations", type=int, default=8, help="rollouts per prompt (G)")
    ap.add_argument("--max-new-tokens", type=int, default=96,
                    help="completion budget, tool tokens included")
    ap.add_argument("--iterations", type=int, default=2, help="max_tool_calling_iterations")
    ap.add_argument("--lr", type=float, default=5e-5)
    ap.add_argument("--sft-steps", type=int, default=1000,
                    help="stage-1 SFT steps that make the shared starting model")
    ap.add_argument("--model", help="the starting model (default: stage 1, made here)")
    ap.add_argument("--model-cache", help="folder for the stage-1 model (default: a temporary one)")
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    quiet_hf()
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            args.model = str(stage_one(args, args.model_cache or tmp))
        load_before = os.getloadavg()[0]
        results = run_frameworks(__file__, args, {"preftune": run_preftune, "trl": run_trl})
    title = (f"Agent GRPO with a tool: {args.steps} steps ({args.warmup} warmup untimed), "
             f"{args.prompts} prompts x {args.generations} rollouts, <= {args.iterations} tool "
             f"rounds in {args.max_new_tokens} tokens, lr {args.lr:g}, beta 0, dapo, the demo's "
             f"stage-1 model ({args.sft_steps} SFT steps)")
    return report(title, args, results, load_before)


if __name__ == "__main__":
    main()
