"""Per-token log-probabilities of completion tokens under a causal LM (shared by GRPO and DPO)."""
from __future__ import annotations

import torch

from preftune.rollout.sampler import positions_from_mask


def completion_logps(
    model,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(y_t | x, y_<t) for each completion token -> (B, T) and optionally the entropy (B, T).

    Logits are divided by the sampling temperature, so the ratio is taken against the distribution
    the completions were drawn from (TRL does the same). Only the last T+1 positions are projected
    to the vocabulary, and log-softmax is taken as logit - logsumexp to avoid a second (B, T, V) copy.
    """
    input_ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+T)
    attn = torch.cat([prompt_mask, completion_mask], dim=1)  # (B, P+T)
    T = completion_ids.size(1)
    out = model(input_ids=input_ids, attention_mask=attn, position_ids=positions_from_mask(attn),
                logits_to_keep=T + 1, use_cache=False)
    logits = out.logits[:, :-1].float()  # (B, T, V): position t predicts completion token t
    if temperature != 1.0:
        logits = logits / temperature
    token_logits = logits.gather(-1, completion_ids.unsqueeze(-1)).squeeze(-1)  # (B, T)
    logps = token_logits - logits.logsumexp(-1)  # (B, T)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            p = logits.softmax(-1)
            entropy = logits.logsumexp(-1) - (p * logits).sum(-1)  # (B, T)
    return logps, entropy


def microbatches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
