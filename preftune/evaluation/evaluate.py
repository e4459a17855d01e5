"""Held-out evaluation: completions for an eval prompt set (greedy, or k samples per prompt), scored
by the reward functions; the per-prompt results and their summary (used in training and by `preftune
eval`)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from preftune.data.prompts import load_prompts
from preftune.data.pipeline import columns, held_out_prompts
from preftune.data.tokenize import PromptTruncation
from preftune.data.traces import TraceOptions
from preftune.errors import UserError
from preftune.evaluation.stats import is_binary, pass_and_mean_at_k
from preftune.losses.advantages import nanmean
from preftune.rewards.functions import RewardLog, RewardState, load_reward_funcs
from preftune.rollout.agent import build_agent
from preftune.rollout.online import act, encode_prompts, score
from preftune.rollout.engine import SamplerEngine


@dataclass
class EvalResult:
    names: list[str]  # reward function names
    total: torch.Tensor  # (n, k) weighted summed reward; NaN = no function applied
    per_func: torch.Tensor  # (n, k, F); NaN = not applicable
    lengths: torch.Tensor  # (n, k) completion tokens (up to and including EOS)
    # what the reward functions logged (log_metric, log_extra)
    log: RewardLog = field(default_factory=RewardLog)

    @classmethod
    def empty(cls, k: int) -> "EvalResult":
        """No prompts (a rank whose share of a small prompt set is empty)."""
        return cls([], torch.zeros(0, k), torch.zeros(0, k, 0), torch.zeros(0, k))

    @classmethod
    def merge(cls, parts: list["EvalResult"]) -> "EvalResult":
        """The parts' prompts in order (each rank's share, gathered in rank order) as one result."""
        full = [r for r in parts if r.total.size(0)] or parts[:1]
        log = RewardLog()
        for r in parts:
            log.add(r.log)
        return cls(full[0].names,
                   *(torch.cat([getattr(r, f) for r in full]) for f in ("total",
                                                                        "per_func", "lengths")),
                   log)


@torch.no_grad()
def generate_scored(model, tokenizer, prompt_set, reward_funcs, *, weights,
                    max_new_tokens: int, batch_size: int,
                    truncation: PromptTruncation, state=None, num_samples: int = 1,
                    sampling: dict | None = None,
                    generator: torch.Generator | None = None,
                    share: slice | None = None, engine=None,
                    seed: int = 0, agent=None) -> EvalResult:
    """Greedy (sampling None, one completion) or `num_samples` sampled completions per prompt with
    `sampling` = {temperature, top_p, top_k} drawn from `generator` (same seed, same draws); of the
    prompts in `share` (default: all). `engine` (`rollout/engine.py`; default the own sampler on
    `model`) samples; vLLM holds the model's weights, its seeds from `seed` and each prompt's index.
    `agent` (`rollout/agent.Agent`): each prompt runs through the tools and environment as in
    training."""
    k = num_samples if sampling is not None else 1
    engine = engine if engine is not None else SamplerEngine()
    if share is None:
        share = slice(0, len(prompt_set))
    totals, per_func, lengths, names, log = [], [], [], [], RewardLog()
    for start in range(share.start, share.stop, batch_size):
        idx = list(range(start, min(start + batch_size, share.stop)))
        kept = []
        prompts, columns, ids = encode_prompts(tokenizer, prompt_set, idx, truncation, kept=kept,
                                               tools=agent.schemas if agent is not None else None)
        if not ids:
            continue
        opts = dict(num_generations=k, eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id,
                    greedy=sampling is None, seed=seed, step=-1, generator=generator,
                    model=model, **(sampling or {}))
        places = [idx[j] for j in kept]
        if agent is not None:  # the turns' budget is training's (grpo.max_completion_length)
            s = act(agent, engine, tokenizer, reward_funcs, weights, state,
                    prompts, columns, ids, places, max_prompt_length=truncation.max_length, **opts)
        else:
            s = score(tokenizer, reward_funcs,
                      engine.generate(ids, places, max_new_tokens=max_new_tokens, **opts),
                      prompts, columns, k, weights, state)
        totals.append(s.total.view(-1, k))
        per_func.append(s.per_func.view(len(ids), k, -1))
        # sampled tokens, not a tool's
        lengths.append(s.rollout.loss_mask().sum(-1).view(-1, k).cpu().float())
        names = s.names
        log.add(s.log)
    if not totals:
        return EvalResult.empty(k)
    return EvalResult(list(names), torch.cat(totals), torch.cat(per_func), torch.cat(lengths), log)


def summarize(r: EvalResult, prefix: str = "eval/") -> dict:
    """Mean reward, per function, mean completion length; with k > 1 samples, pass@k and mean@k of
    every 0/1 reward (the total and each function); what the reward functions logged, under the
    prefix."""
    out = {f"{prefix}reward": nanmean(r.total), f"{prefix}num_prompts": r.total.size(0),
           f"{prefix}completions/mean_length": r.lengths.mean().item()}
    out |= {f"{prefix}{k}": v for k, v in r.log.record().items()}
    for j, name in enumerate(r.names):
        out[f"{prefix}rewards/{name}/mean"] = nanmean(r.per_func[..., j])
    k = r.total.size(1)
    if k > 1:
        series = [("", r.total)] + [(f"/{n}", r.per_func[..., j]) for j, n in enumerate(r.names)]
        for suffix, x in series:
            if is_binary(x):
                out[f"{prefix}pass@{k}{suffix}"], out[f"{prefix}mean@{k}{suffix}"] = (
                    pass_and_mean_at_k(x, k)
                )
    return out


def evaluate(model, tokenizer, prompt_set, reward_funcs, *, weights,
             max_new_tokens: int, batch_size: int,
             truncation: PromptTruncation, state=None, dp=None, engine=None, agent=None) -> dict:
    """`eval/reward` = mean over held-out prompts of the (weighted) summed reward of the greedy
    completion. With `dp` (distributed/group.py's `Parallel`), each rank generates and scores its
    contiguous share of the prompts and every rank summarises all of them (a gather of the
    per-prompt scores).
    `engine`: sample with the rollout engine, after pushing the model's current weights to it (and
    put it back to sleep after, under grpo.vllm_enable_sleep_mode)."""
    if engine is not None:  # vLLM: the current weights; the own sampler reads the module itself
        engine.push(model)

    def scored(share: slice | None = None) -> EvalResult:
        return generate_scored(model, tokenizer, prompt_set, reward_funcs,
                               weights=weights, share=share,
                               max_new_tokens=max_new_tokens, batch_size=batch_size,
                               truncation=truncation, state=state, engine=engine, agent=agent)

    tp = engine.tp if engine is not None else 1
    if dp is None:
        result = scored()
    # a tensor-parallel engine's ranks sample the group's prompts together; the first keeps them
    elif tp > 1:
        part = dp.together(lambda: scored(dp.engine_group_share(len(prompt_set), tp)))
        result = EvalResult.merge(
            dp.gather(part if dp.rank % tp == 0 else EvalResult.empty(part.total.size(1)))
        )
    else:
        # a reward's UserError stops every rank
        part = dp.together(lambda: scored(dp.balanced_share(len(prompt_set))))
        result = EvalResult.merge(dp.gather(part))
    if engine is not None:
        engine.sleep()
    return summarize(result)


def eval_prompt_set(cfg):
    """data.eval, else with eval.split the held-out prompts of data.train, else None."""
    if cfg.data.eval and {"chosen", "rejected"} <= set(columns(cfg.data.eval)):
        raise UserError("is a pairs file: held-out pairs are evaluated by DPO training and by "
                        "`preftune eval` (eval/loss, eval/rewards/accuracies); here data.eval "
                        "takes prompts, scored by eval.reward_funcs", where="data.eval")
    if cfg.data.eval:
        return load_prompts(cfg.data.eval, prompt_column=cfg.data.prompt_column)
    if cfg.eval.split:
        return held_out_prompts(cfg.data.train, cfg.eval.split, TraceOptions.from_config(cfg.data))
    return None


def eval_reward_funcs(cfg, device="cpu") -> tuple[list, list | None]:
    """(functions, weights): eval.reward_funcs unweighted, or grpo.reward_funcs with
    grpo.reward_weights; reward models on `device` (the evaluated model's)."""
    funcs = load_reward_funcs(cfg.eval.reward_funcs or cfg.grpo.reward_funcs, cfg.grpo,
                              cfg.config_dir, device)
    return funcs, cfg.grpo.reward_weights if cfg.eval.reward_funcs is None else None


def with_environment_reward(funcs: list, weights: list | None, agent) -> tuple[list, list | None]:
    """An environment's get_reward scores held-out tasks too (weight 1, as in training)."""
    if agent is None or agent.envs is None or not agent.envs.has_reward:
        return funcs, weights
    return [*funcs, agent.envs.reward_func()], None if weights is None else [*weights, 1.0]


def build_evaluator(cfg, tokenizer, dp=None, engine=None, agent=None):
    """A callable (model, step) -> eval metrics, or None when the config has no held-out prompts;
    with `dp`, the prompts split over the ranks (`evaluate`); with `engine`, sampled by it; with
    `agent`, through training's tools and environment; without one, through grpo.tools /
    grpo.environment_factory when the config names them (SFT, DPO and KTO of an agent)."""
    prompt_set = eval_prompt_set(cfg)
    if prompt_set is None:
        return None
    if agent is None:
        agent = build_agent(cfg.grpo, tokenizer, cfg.config_dir)

    funcs, weights = with_environment_reward(
        *eval_reward_funcs(cfg, dp.device if dp is not None else "cpu"), agent
    )
    truncation = PromptTruncation(cfg.data.max_prompt_length, "left")
    max_new = cfg.eval.max_new_tokens or cfg.grpo.max_completion_length

    def run(model, step: int) -> dict:
        return evaluate(model, tokenizer, prompt_set, funcs, weights=weights,
                        max_new_tokens=max_new,
                        batch_size=cfg.eval.batch_size, truncation=truncation,
                        state=RewardState(global_step=step, max_steps=cfg.max_steps),
                        dp=dp, engine=engine, agent=agent)

    return run
