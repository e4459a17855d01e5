"""DPO speed: preftune vs TRL's DPOTrainer on the same pairs, in one run; prints s/step and ratios.

Same work for both: the embedded model (examples/model), the same preference pairs, B pairs per
optimiser step in one forward/backward (chosen and rejected together), sigmoid loss, beta 0.1,
AdamW constant lr, reference log-probs computed once before training (preftune's cached
reference; TRL precompute_ref_log_probs=True), so no reference model runs during the steps.

Pairs: from examples/data/traces.parquet (labeled traces) with preftune's rule, chosen reward >=
0.7, rejected < 0.5, best_vs_worst; preftune pairs them itself (`algorithm: dpo` on the traces) and
TRL gets the same pairs from preftune.data.pairs.build_pairs as prompt/chosen/rejected rows. When
the traces file is missing, a small synthetic pairs set of the a+b task (correct sum vs a wrong one)
is written as a pairs file and used by both. Timing as in bench_grpo.py. From the repo root:

    .venv/bin/python bench/bench_dpo.py [--steps 50] [--json out.json]
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

if __package__:
    from bench import workload
    from bench.bench_grpo import (check_args, common_args, dtype_overrides, finish,
                                  first_last, max_prompt_length,
                                  model_args, precision, quiet_hf,
                                  quiet_trainer, read_metrics, report,
                                  run_frameworks, step_timer, summarize)
else:  # run as a script: bench/ is on sys.path
    import workload
    from bench_grpo import (check_args, common_args, dtype_overrides, finish,
                            first_last, max_prompt_length,
                            model_args, precision, quiet_hf, quiet_trainer, read_metrics,
                            report, run_frameworks, step_timer, summarize)

EXAMPLES = workload.EXAMPLES

CHOSEN_MIN, REJECTED_MAX = 0.7, 0.5


def synthetic_pairs(n: int = 128, prefix: int = 0, response: int = 0) -> list:
    """a+b pairs: chosen = the right sum, rejected = a sum off by 1..3 (deterministic); `prefix`
    tokens of shared text before each prompt, responses lengthened to about `response` tokens."""
    from preftune.data.pairs import Pair

    rows = workload.prompt_rows(prefix)[:n]
    tail = (workload.FILLER * (response // len(workload.FILLER) + 1))[:max(response - 3, 0)]
    return [Pair(r["input"], r["answer"] + tail, str(int(r["answer"]) + 1 + i % 3) + tail, 1.0, 0.0)
            for i, r in enumerate(rows)]


def dpo_data(traces: Path, tmp: str, prefix: int = 0, response: int = 0) -> tuple[str, list]:
    """(the file preftune trains on, the pairs TRL trains on): traces when they exist (and no length
    is asked for), else synthetic pairs."""
    from preftune.data.pairs import build_pairs, write_pairs
    from preftune.data.traces import TraceOptions, load_traces

    if traces.exists() and not (prefix or response):
        # The example traces hold a few empty completions (an immediate EOS); preftune's default
        # data.invalid=error rejects them, so both sides drop them.
        rows, _ = load_traces(str(traces), TraceOptions(invalid="drop"))
        pairs, _ = build_pairs(rows, chosen_min=CHOSEN_MIN, rejected_max=REJECTED_MAX,
                               strategy="best_vs_worst")
        return str(traces), pairs
    pairs = synthetic_pairs(prefix=prefix, response=response)
    path = os.path.join(tmp, "pairs.parquet")
    write_pairs(pairs, path)
    return path, pairs


def mean_lengths(model: Path, pairs: list) -> tuple[float, float]:
    """Mean prompt and response tokens of the first 64 pairs (chosen and rejected alike)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    sample = pairs[:64]
    prompt = statistics.fmean(len(tok(p.prompt).input_ids) for p in sample)
    def tokens(text):  # long responses: no length warning
        return len(tok(text, verbose=False).input_ids)

    response = statistics.fmean(tokens(p.chosen) + tokens(p.rejected) for p in sample) / 2
    return prompt, response


def dpo_work(args, model: Path, pairs: list) -> tuple[dict, float]:
    """Nominal FLOPs per step by phase and response tokens per step (mean lengths of these
    pairs)."""
    prompt, response = mean_lengths(model, pairs)
    flops = workload.dpo_flops(workload.model_shape(model), pairs=args.batch,
                               prompt=prompt, response=response)
    return flops, 2 * args.batch * response


def dpo_overrides(args, out_dir: str, train: str, model: Path) -> list[str]:
    return ["algorithm=dpo", f"output_dir={out_dir}", f"max_steps={args.steps}",
            "save_steps=0", f"seed={args.seed}",
            *dtype_overrides(args), f"model.name_or_path={model}",
            f"data.train={train}", "data.invalid=drop",
            f"data.max_prompt_length={max_prompt_length(args)}",
            f"dpo.max_length={max_prompt_length(args) + args.response_len}",
            f"data.chosen_min={CHOSEN_MIN}", f"data.rejected_max={REJECTED_MAX}",
            "data.pair_strategy=best_vs_worst",
            "dpo.loss_type=sigmoid", f"dpo.beta={args.beta}", f"dpo.batch_size={args.batch}",
            f"dpo.micro_batch_size={args.batch}", f"optim.lr={args.lr}",
            "optim.lr_scheduler=constant", "log.progress_bar=false", "log.logging_steps=1"]


def run_preftune_dpo(args) -> dict:
    import json

    import preftune.algorithms.dpo as dpo
    from preftune.config import load_config
    from preftune.model.load import compute_dtype
    from preftune.distributed.group import Parallel
    from preftune.run.loop import Run

    timer = workload.PhaseTimer()
    with tempfile.TemporaryDirectory() as tmp:
        model = workload.model_dir(args.model, args.model_cache or tmp)
        train, pairs = dpo_data(Path(args.traces), tmp, args.prompt_prefix, args.response_len)
        out = os.path.join(tmp, "run")
        # reference log-probs cached here
        run = Run(load_config(None, dpo_overrides(args, out, train, model)), Parallel())
        timer.wrap(dpo, "sequence_logps")  # both layouts (tree-packed and bucketed)
        timer.wrap_backward()
        t0 = time.perf_counter()
        run.run()
        wall = time.perf_counter() - t0
        records = read_metrics(out)
        n_pairs = json.loads(Path(out, "data_report.json").read_text())["encoded"]["pairs"]
        flops, tokens = dpo_work(args, model, pairs)
    result = summarize([r["step_time"] for r in records], args.warmup) | {"wall_s": wall}
    result["extra"] = {
        "pairs": str(n_pairs),
        "loss first->last": first_last([r.get("loss") for r in records]),
        "reward acc first->last": first_last([r.get("rewards/accuracies") for r in records]),
    }
    result["precision"] = precision(run.model, compute_dtype(run.model) is not None)
    return finish(result, timer, flops, tokens, len(records))


def run_trl_dpo(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    timer = workload.PhaseTimer()
    step_times = step_timer()
    with tempfile.TemporaryDirectory() as tmp:
        model_path = workload.model_dir(args.model, args.model_cache or tmp)
        tok = AutoTokenizer.from_pretrained(model_path)
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        _, pairs = dpo_data(Path(args.traces), tmp, args.prompt_prefix, args.response_len)
        ds = Dataset.from_list(
            [{"prompt": p.prompt, "chosen": p.chosen, "rejected": p.rejected} for p in pairs]
        )
        cfg = DPOConfig(
            output_dir=os.path.join(tmp, "run"), max_steps=args.steps,
            per_device_train_batch_size=args.batch,
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0, beta=args.beta,
            loss_type=["sigmoid"], precompute_ref_log_probs=True,
            max_length=max_prompt_length(args) + args.response_len,
            max_grad_norm=1.0, gradient_checkpointing=False,
            use_cpu=not torch.cuda.is_available(), bf16=args.bf16,
            report_to="none", save_strategy="no", logging_steps=1, seed=args.seed,
            dataloader_num_workers=0, disable_tqdm=True)
        trainer = DPOTrainer(model=model, args=cfg, train_dataset=ds, processing_class=tok,
                             callbacks=[step_times])
        quiet_trainer(trainer)
        timer.wrap(trainer, "compute_loss", "forward")
        timer.wrap_backward()
        t0 = time.perf_counter()
        trainer.train()
        wall = time.perf_counter() - t0
        flops, tokens = dpo_work(args, model_path, pairs)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    result = summarize(step_times.times, args.warmup) | {"wall_s": wall}
    result["extra"] = {
        "pairs": str(len(pairs)),
        "loss first->last": first_last([h["loss"] for h in logs]),
        "reward acc first->last": first_last([h.get("rewards/accuracies") for h in logs]),
    }
    result["precision"] = precision(trainer.model, trainer.accelerator.mixed_precision == "bf16")
    return finish(result, timer, flops, tokens, len(step_times.times))


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common_args(ap, steps=50)
    ap.add_argument("--batch", type=int, default=16, help="pairs per optimiser step")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--beta", type=float, default=0.1)
    ap.add_argument("--traces", default=str(EXAMPLES / "data" / "traces.parquet"),
                    help="labeled traces to pair; when missing, synthetic a+b pairs are used")
    ap.add_argument("--response-len", type=int, default=0,
                    help="synthetic pairs with responses of about "
                    "this many tokens (0: the traces' own)")
    model_args(ap)
    return ap


def main(argv: list[str] | None = None) -> dict:
    ap = build_parser()
    args = ap.parse_args(argv)
    check_args(ap, args)
    quiet_hf()
    load_before = os.getloadavg()[0]
    results = run_frameworks(__file__, args, {"preftune": run_preftune_dpo, "trl": run_trl_dpo})
    source = (
        "traces"
        if Path(args.traces).exists() and not (args.prompt_prefix or args.response_len)
        else "synthetic pairs"
    )
    title = (f"DPO: {args.steps} steps ({args.warmup} warmup untimed), {args.batch} pairs/step "
             f"from {source}, sigmoid, beta {args.beta:g}, lr {args.lr:g}, precomputed reference "
             f"log-probs, model {args.model}, prompt prefix {args.prompt_prefix}, responses "
             f"{args.response_len or 'as in the data'}{', bf16 autocast' if args.bf16 else ''}")
    return report(title, args, results, load_before)


if __name__ == "__main__":
    main()
