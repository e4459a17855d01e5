"""Held-out evaluation: greedy decoding on an eval prompt set, scored by the reward functions."""
from __future__ import annotations

import torch

from preftune.data.tokenize import PromptTruncation
from preftune.losses.advantages import nanmean
from preftune.rollout.online import encode_prompts, score
from preftune.rollout.sampler import left_pad, sample


@torch.no_grad()
def evaluate(model, tokenizer, prompt_set, reward_funcs, *, weights, max_new_tokens: int, batch_size: int,
             truncation: PromptTruncation, state=None) -> dict:
    """`eval/reward` = mean over held-out prompts of the (weighted) summed reward of the greedy completion."""
    totals, per_func, names = [], [], []
    for start in range(0, len(prompt_set), batch_size):
        idx = list(range(start, min(start + batch_size, len(prompt_set))))
        prompts, columns, ids = encode_prompts(tokenizer, prompt_set, idx, truncation)
        if not ids:
            continue
        p_ids, p_mask = left_pad(ids, tokenizer.pad_token_id)
        ro = sample(model, p_ids, p_mask, num_generations=1, max_new_tokens=max_new_tokens,
                    eos_id=tokenizer.eos_token_id, pad_id=tokenizer.pad_token_id, greedy=True)
        s = score(tokenizer, reward_funcs, ro, prompts, columns, 1, weights, state)
        totals.append(s.total)
        per_func.append(s.per_func)
        names = s.names
    total = torch.cat(totals)  # (n,)
    pf = torch.cat(per_func)  # (n, F)
    out = {"eval/reward": nanmean(total), "eval/num_prompts": len(total)}
    for j, name in enumerate(names):
        out[f"eval/reward/{name}"] = nanmean(pf[:, j])
    return out


def build_evaluator(cfg, tokenizer):
    """A callable (model, step) -> eval metrics, or None when the config names no eval prompt set."""
    if not cfg.data.eval:
        return None
    from preftune.data.prompts import load_prompts
    from preftune.rewards.registry import RewardState, load_reward_funcs

    prompt_set = load_prompts(cfg.data.eval, prompt_column=cfg.data.prompt_column)
    specs = cfg.eval.reward_funcs or cfg.grpo.reward_funcs
    funcs = load_reward_funcs(specs, cfg.grpo, cfg.config_dir)
    weights = cfg.grpo.reward_weights if cfg.eval.reward_funcs is None else None
    truncation = PromptTruncation(cfg.data.max_prompt_length, "left")
    max_new = cfg.eval.max_new_tokens or cfg.grpo.max_completion_length

    def run(model, step: int) -> dict:
        return evaluate(model, tokenizer, prompt_set, funcs, weights=weights, max_new_tokens=max_new,
                        batch_size=cfg.eval.batch_size, truncation=truncation, state=RewardState(global_step=step))

    return run
