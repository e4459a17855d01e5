"""The plan's step time (the passes' FLOPs at a stated MFU, generation at a stated tokens/s) and
its cost per run (preftune/deploy/cost.py's estimate), for `plan.make_plan`. No torch."""
from __future__ import annotations

from preftune.deploy import cost
from preftune.errors import UserError


def _train_tokens(cfg) -> tuple[int, int]:
    """(tokens through the training passes per step, completion tokens generated per step)."""
    a = cfg.algorithm
    if a == "grpo":
        g = cfg.grpo  # a group's prompt is laid out once (model/logps._plan)
        return (
            g.prompts_per_step
            * (cfg.data.max_prompt_length + g.num_generations * g.max_completion_length),
            g.prompts_per_step * g.num_generations * g.max_completion_length,
        )
    sec = getattr(cfg, a)
    return sec.batch_size * sec.max_length * (2 if a == "dpo" else 1), 0


def step_time(cfg, s, j, t, mfu: float, gen_tps: float) -> dict:
    """Seconds per optimiser step: the passes' FLOPs at `mfu` of the GPUs' dense bf16 peak, plus
    generation at `gen_tps` tokens/s per GPU (decoding is bound by memory, not FLOPs). `s`, `j`,
    `t`: plan.Shape, Job and Target (not imported here: plan imports this module)."""
    tokens, generated = _train_tokens(cfg)
    # forward: projections + attention (causal mean)
    per_token = 2 * s.matmul + 2 * s.layers * s.q * j.seq
    train = (3 + (1 if j.checkpointing else 0)) * per_token * tokens
    iters = cfg.grpo.num_iterations if j.algorithm == "grpo" else 1
    extra = 0.0
    if j.reference in ("model", "adapter"):
        extra += per_token * tokens / iters
    if j.sampler == "vllm" and cfg.grpo.vllm_importance_sampling_correction:
        extra += per_token * tokens / iters
    if j.algorithm == "kto" and cfg.kto.loss_type == "kto":
        extra += per_token * tokens  # the mismatched pairs' KL pass
    flops = train + extra
    gpus = t.world
    compute_s = flops / (gpus * t.node.bf16_tflops * 1e12 * mfu)
    gen_s = generated / iters / (gen_tps * gpus)
    step = compute_s + gen_s
    return {"flops_per_step": flops, "mfu": mfu, "peak_tflops_per_gpu": t.node.bf16_tflops,
            "generation_tokens_per_second_per_gpu": gen_tps if generated else None,
            "compute_s": round(compute_s, 3), "generation_s": round(gen_s, 3),
            "step_s": round(step, 3), "steps": cfg.max_steps, "hours": step * cfg.max_steps / 3600,
            "tokens_per_second_per_gpu": round(tokens / step / gpus, 1) if step else None}


def run_cost(cfg, t, time: dict, prices: dict | None) -> dict | None:
    """The cost of max_steps steps: preftune/deploy/cost.py's estimate, hours from the step time."""
    try:
        prices = prices if prices is not None else cost.load_prices()
        price = cost.gpu_hour_price(prices, [t.name], t.capacity_type)
    except UserError as e:
        return {"note": str(e)}
    hours = (time["hours"], time["hours"])
    return cost.estimate(cost.CostInputs(t.nodes, t.procs_per_node, t.capacity_type,
                                         [t.name], price, hours))
