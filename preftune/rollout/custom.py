"""A user's rollout function (`preftune.train(rollout_func=...)`, `grpo.rollout_func`), TRL 1.16's
contract: `rollout_func(prompts, trainer) -> {"prompt_ids", "completion_ids", "logprobs"}` with an
optional `env_mask` (1 for the policy's tokens, 0 for tokens it did not sample: they leave the
loss as tool tokens do) and any other field, one value per completion, handed to the reward
functions. `prompts` are this rank's prompts, each once; the function returns num_generations
completions per prompt, group-contiguous.

`trainer` is a `RolloutContext`, not a trainer: `args` (the GRPOConfig), `processing_class`
(the tokenizer), `num_generations`, `state` (global_step, max_steps) and `generate`, which
samples with the run's engine (the own sampler or vLLM) from token ids.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from preftune.errors import UserError
from preftune.rollout.agent import Trajectory, assemble
from preftune.rollout.sampler import Rollout

REQUIRED = ("prompt_ids", "completion_ids", "logprobs")
WHERE = "grpo.rollout_func"


@dataclass
class RolloutContext:
    args: Any
    processing_class: Any
    num_generations: int
    state: Any
    engine: Any
    model: Any
    options: dict  # the engine's sampling options and seeds for this round

    def generate(self, prompt_ids: list[list[int]], num_generations: int = 1,
                 max_new_tokens: int | None = None,
                 turn: int = 0) -> tuple[list[list[int]], list[list[float]]]:
        """num_generations completions of each prompt (token ids, each up to and including its stop
        token) -> (completion ids, their log-probs under the sampling distribution: vLLM's; 0.0
        from the own sampler, which is on-policy and needs none)."""
        opts = self.options | {"num_generations": num_generations, "turn": turn,
                               "max_new_tokens": max_new_tokens or self.args.max_completion_length}
        ro = self.engine.generate(prompt_ids, list(range(len(prompt_ids))),
                                  model=self.model, **opts)
        n = ro.completion_mask.sum(-1).tolist()
        ids = [row[:k] for row, k in zip(ro.completion_ids.tolist(), n)]
        lps = [[0.0] * k for k in n] if ro.sampling_logps is None else \
            [row[:k] for row, k in zip(ro.sampling_logps.tolist(), n)]
        return ids, lps


def run_rollout_func(func: Callable, prompts: list, ctx: RolloutContext, eos_id: int,
                     pad_id: int) -> tuple[Rollout, dict]:
    """The function's output, checked, as a Rollout (+ the extra fields for the rewards)."""
    out = func(prompts, ctx)
    if not isinstance(out, dict) or any(k not in out for k in REQUIRED):
        raise UserError(
            f"rollout_func must return a dict with {', '.join(REQUIRED)} "
            f"(got {sorted(out) if isinstance(out, dict) else type(out).__name__})",
            where=WHERE,
        )
    n = len(prompts) * ctx.num_generations
    p_ids, c_ids, lps = out["prompt_ids"], out["completion_ids"], out["logprobs"]
    mask = out.get("env_mask")
    for name, col in (("prompt_ids", p_ids), ("completion_ids", c_ids),
                      ("logprobs", lps), ("env_mask", mask)):
        if col is not None and len(col) != n:
            raise UserError(f"rollout_func returned {len(col)} {name} for {len(prompts)} prompts x "
                            f"{ctx.num_generations} generations", where=WHERE)
    for i, ids in enumerate(c_ids):
        for name, col in (("logprobs", lps), ("env_mask", mask)):
            if col is not None and len(col[i]) != len(ids):
                raise UserError(f"completion {i}: {len(col[i])} "
                                f"{name} for {len(ids)} completion ids", where=WHERE)
    if any(not p for p in p_ids):
        raise UserError("rollout_func returned an empty prompt", where=WHERE)
    extra = {k: list(v) for k, v in out.items() if k not in (*REQUIRED, "env_mask")}
    rows = [Trajectory(list(p), list(c), list(mask[i]) if mask is not None else [1] * len(c),
                       [float(x) for x in lps[i]] if lps is not None else [0.0] * len(c),
                       truncated=not c or c[-1] != eos_id) for i,
            (p, c) in enumerate(zip(p_ids, c_ids))]
    ro = assemble(rows, pad_id, with_logps=ctx.engine.with_logps and lps is not None)
    if mask is None:
        ro.tool_mask = None
    return ro, extra
