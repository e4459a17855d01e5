"""`preftune plan`'s text: the plan (`deploy/plan.make_plan`'s dict) as the terms-by-phase tables
per GPU and per host, the step time, the cost and the verdict."""
from __future__ import annotations

from preftune.deploy.cost import money, number
from preftune.deploy.plan import GB


def _table(plan: dict, host: bool | None, unit: float) -> list[str]:
    """Terms (rows) by phase (columns), in `unit` (GB or MB); the arithmetic beside each term.
    `host` None: every term (a CPU run, where both are the process's memory)."""
    names = [p["name"] for p in plan["phases"]]
    rows: dict[str, dict] = {}
    for p in plan["phases"]:
        for t in p["terms"]:
            if host is None or t["host"] == host:
                name = t["name"] + (" (rank 0)" if t["rank0"] and plan["job"]["ranks"] > 1 else "")
                rows.setdefault(name, {"how": t["how"], "by": {}})["by"][p["name"]] = t["gb"] / unit
    width = max([len(n) for n in rows] + [24])
    how = max([len(r["how"]) for r in rows.values()] + [10])
    lines = [f"  {'':{width}}  {'':{how}}" + "".join(f"{n:>10}" for n in names)]
    for name, row in rows.items():
        lines.append(f"  {name:{width}}  {row['how']:{how}}" + "".join(
            f"{row['by'][n]:>10.2f}" if n in row["by"] else f"{'':>10}" for n in names))
    lines.append(f"  {'total':{width + how + 2}}" + "".join(f"{v:>10.2f}" for v in (
        sum(r["by"].get(n, 0.0) for r in rows.values()) for n in names)))
    return lines


def format_plan(plan: dict) -> str:
    j = plan["job"]
    lines = [f"plan: {j['algorithm']} on {j['where']}: {j['ranks']} rank(s), {j['strategy']}"
             f"{' (CPU offload)' if j.get('cpu_offload') else ''}, {j['dtype']}"
             f"{', LoRA' if j['lora'] else ''}"
             f"{', gradient checkpointing' if j['gradient_checkpointing'] else ''}",
             f"model: {j['model']}; {j['module']} module",
             f"per rank: {j['sequences_per_rank']} sequences of <= "
             f"{j['tokens_per_sequence']} tokens, micro-batch {j['micro_batch']}; "
             f"reference: {j['reference']}; sampler: {j['sampler']}"]
    for key, title, host in (("gpu", "per GPU", False), ("process", "per process", None),
                             ("host", "per host", True)):
        if key not in plan:
            continue
        v = plan[key]
        unit, label = (GB / GB, "GB") if v["peak_gb"] >= 1 else (1e6 / GB, "MB")
        lines.append(f"{title}, {label} ({v['note']})")
        lines += _table(plan, host, unit)
        if key != "process":
            lines.append("  + runtime per phase: "
                         f"{', '.join(f'{n} {x:.1f} GB' for n, x in v['runtime_gb'].items())}"
                         if len(set(v["runtime_gb"].values())) > 1 else
                         f"  + runtime {next(iter(v['runtime_gb'].values())):.1f} GB")
        lines.append(
            _peak(v, unit, label)
            + (f"; Pod memory request {v['pod_memory']}" if key == "host" else "")
        )
    if "time" in plan:
        t = plan["time"]
        gen = (f" + generation {t['generation_s']:.1f} s at "
               f"{t['generation_tokens_per_second_per_gpu']:g} "
               "tokens/s/GPU" if t["generation_tokens_per_second_per_gpu"] else "")
        lines.append(f"step: {t['flops_per_step']:.3g} FLOPs at {t['mfu']:g} MFU of "
                     f"{t['peak_tflops_per_gpu']:g} TFLOPs/GPU = {t['compute_s']:.1f} s{gen} = "
                     f"{t['step_s']:.1f} s; {t['steps']} steps = {t['hours']:.2f} hours")
    if plan.get("cost"):
        c = plan["cost"]
        if "note" in c:
            lines.append(f"cost: {c['note']}")
        else:
            lines.append(f"cost per iteration: {money(c['compute_usd'])} (compute, "
                         f"{c['inputs']['gpus']} GPUs at "
                         f"${number(c['inputs']['price_per_gpu_hour'])} per GPU-hour)")
    if "vllm" in plan:
        v = plan["vllm"]
        lines.append(f"vLLM engine: {v['engine_gb']:.1f} GB per GPU, KV cache "
                     f"{v['kv_cache_gb']:.1f} GB; sleep mode hands back {v['handed_back_gb']:.1f} "
                     "GB for the training passes")
    lines.append(f"verdict: {plan['verdict']}")
    return "\n".join(lines)


def _peak(v: dict, unit: float, label: str) -> str:
    return (f"  peak {v['peak_gb'] / unit:.1f} {label} ({v['peak_phase']}) of "
            f"{v['capacity_gb']:.1f} GB: headroom {v['headroom_gb']:.1f} GB, {v['verdict']}")
