"""A lean batched sampler with a KV cache.

`generate()` spends most of a small model's step in per-token Python machinery (logits processors,
stopping criteria, cache bookkeeping). This loop does only what GRPO needs: prefill each distinct
prompt once, copy its cache G times, then one forward per new token with the last-token logits.
Positions come from the attention mask, so a left-padded prompt sees the same positions as an
unpadded one, here and in the training forward pass (`train/logps.py` calls `positions_from_mask`).
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Rollout:
    """Everything downstream of the sampler takes a Rollout. N = prompts * G, group-contiguous."""

    prompt_ids: torch.Tensor  # (N, P) left-padded
    prompt_mask: torch.Tensor  # (N, P)
    completion_ids: torch.Tensor  # (N, T) right-padded with pad_id
    completion_mask: torch.Tensor  # (N, T) 1 up to and including EOS
    truncated: torch.Tensor  # (N,) bool: no EOS within max_new_tokens
    old_logps: torch.Tensor | None = None  # (N, T) recorded at generation time when reused

    def to(self, device) -> "Rollout":
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return Rollout(*(move(getattr(self, k)) for k in self.__slots__))


def positions_from_mask(mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip left padding: (B, L) mask -> (B, L) positions."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)  # (B, L)


def cache_kwarg(model) -> str:
    """transformers renamed `past_key_values` to `cache` in 5.x; use whichever the model takes."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"


def left_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, P)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, P)
    for i, s in enumerate(seqs):
        if s:
            ids[i, width - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, width - len(s):] = 1
    return ids, mask


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Top-k then nucleus (top-p) filtering; removed entries become -inf. (B, V) -> (B, V)."""
    if top_k and 0 < top_k < logits.size(-1):
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True, dim=-1)  # (B, V)
        probs = sorted_logits.softmax(-1)
        # drop a token when the mass *before* it already reaches top_p (the top token always stays)
        drop_sorted = probs.cumsum(-1) - probs >= top_p  # (B, V)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


@torch.no_grad()
def sample(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    *,
    num_generations: int,
    max_new_tokens: int,
    eos_id: int,
    pad_id: int,
    temperature: float = 1.0,
    top_p: float = 1.0,
    top_k: int = 0,
    greedy: bool = False,
    generator: torch.Generator | None = None,
) -> Rollout:
    """Sample `num_generations` completions for each of B prompts -> Rollout with N = B * G rows."""
    from preftune.models import autocast

    was_training = model.training
    model.eval()  # dropout off, and HF keeps the cache on even with gradient checkpointing
    try:
        with autocast(model):
            return _sample(model, prompt_ids, prompt_mask, num_generations, max_new_tokens, eos_id, pad_id,
                           temperature, top_p, top_k, greedy, generator)
    finally:
        model.train(was_training)


def _sample(model, prompt_ids, prompt_mask, G, max_new_tokens, eos_id, pad_id, temperature, top_p, top_k, greedy,
            generator) -> Rollout:
    from transformers import DynamicCache

    device = next(model.parameters()).device
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    cache = DynamicCache()  # filled in place by each forward
    kw = cache_kwarg(model)
    out = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions_from_mask(prompt_mask),
                use_cache=True, logits_to_keep=1, **{kw: cache})
    logits = out.logits[:, -1].float()  # (B, V)
    if G > 1:  # prefill once per distinct prompt, then copy
        cache.batch_repeat_interleave(G)
        logits = logits.repeat_interleave(G, 0)  # (N, V)
    mask = prompt_mask.repeat_interleave(G, 0)  # (N, P)
    next_pos = mask.sum(-1, keepdim=True)  # (N, 1)
    N = logits.size(0)
    tokens = torch.full((N, max_new_tokens), pad_id, dtype=torch.long, device=device)  # (N, T)
    done = torch.zeros(N, dtype=torch.bool, device=device)  # (N,)
    for t in range(max_new_tokens):
        if greedy:
            tok = logits.argmax(-1)  # (N,)
        else:
            probs = filter_logits(logits / temperature, top_k, top_p).softmax(-1)  # (N, V)
            tok = torch.multinomial(probs, 1, generator=generator).squeeze(-1)  # (N,)
        tok = torch.where(done, torch.full_like(tok, pad_id), tok)
        tokens[:, t] = tok
        done |= tok == eos_id
        if bool(done.all()) or t == max_new_tokens - 1:
            break
        mask = torch.cat([mask, (~done | (tok == eos_id)).long()[:, None]], dim=1)  # (N, P+t+1)
        out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=next_pos, use_cache=True,
                    **{kw: cache})
        logits = out.logits[:, -1].float()
        next_pos = next_pos + 1
    return _assemble(prompt_ids.repeat_interleave(G, 0), prompt_mask.repeat_interleave(G, 0), tokens, eos_id)


def _assemble(prompt_ids, prompt_mask, tokens, eos_id) -> Rollout:
    is_eos = tokens == eos_id  # (N, T)
    has_eos = is_eos.any(-1)  # (N,)
    no_eos = torch.full_like(has_eos, tokens.size(1), dtype=torch.long)  # (N,)
    first_eos = torch.where(has_eos, is_eos.float().argmax(-1), no_eos)
    idx = torch.arange(tokens.size(1), device=tokens.device)[None]  # (1, T)
    completion_mask = (idx <= first_eos[:, None]).long()  # (N, T) includes the EOS token
    length = int(completion_mask.sum(-1).max().item()) if tokens.numel() else 0
    return Rollout(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=tokens[:, :max(length, 1)],
                   completion_mask=completion_mask[:, :max(length, 1)], truncated=~has_eos)


def select(ro: Rollout, rows: torch.Tensor | list[int]) -> Rollout:
    rows = torch.as_tensor(rows, dtype=torch.long, device=ro.completion_ids.device)
    pick = lambda t: None if t is None else t[rows]  # noqa: E731
    return Rollout(prompt_ids=ro.prompt_ids[rows], prompt_mask=ro.prompt_mask[rows],
                   completion_ids=ro.completion_ids[rows], completion_mask=ro.completion_mask[rows],
                   truncated=ro.truncated[rows], old_logps=pick(ro.old_logps))


def concat(rollouts: list[Rollout], pad_id: int) -> Rollout:
    """Stack rollouts of different widths: prompts stay left-padded, completions right-padded."""
    if len(rollouts) == 1:
        return rollouts[0]
    P = max(r.prompt_ids.size(1) for r in rollouts)
    T = max(r.completion_ids.size(1) for r in rollouts)

    def lpad(t, width, value):
        return torch.nn.functional.pad(t, (width - t.size(1), 0), value=value)

    def rpad(t, width, value):
        return torch.nn.functional.pad(t, (0, width - t.size(1)), value=value)

    has_old = all(r.old_logps is not None for r in rollouts)
    return Rollout(
        prompt_ids=torch.cat([lpad(r.prompt_ids, P, pad_id) for r in rollouts]),
        prompt_mask=torch.cat([lpad(r.prompt_mask, P, 0) for r in rollouts]),
        completion_ids=torch.cat([rpad(r.completion_ids, T, pad_id) for r in rollouts]),
        completion_mask=torch.cat([rpad(r.completion_mask, T, 0) for r in rollouts]),
        truncated=torch.cat([r.truncated for r in rollouts]),
        old_logps=torch.cat([rpad(r.old_logps, T, 0.0) for r in rollouts]) if has_old else None,
    )


def right_pad(seqs: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(1, max(len(s) for s in seqs))
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)  # (B, T)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return ids, mask
