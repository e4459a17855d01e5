"""Per-token log-probabilities of completion tokens under a causal LM (shared by GRPO and DPO)."""
from __future__ import annotations

import torch

from preftune.models import autocast
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

    The batch is laid out aligned (left-padded prompts, right-padded completions) or packed (each
    row's prompt+completion moved left), whichever `_layout` estimates cheaper: packing pays off
    when prompt lengths vary a lot. Only positions that predict completion tokens are projected to
    the vocabulary; logits are divided by the sampling temperature (the ratio is taken against the
    distribution the completions were drawn from, as TRL does); log-softmax is logit - logsumexp.
    """
    ids, attn, keep, idx = _layout(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    with autocast(model):
        out = model(input_ids=ids, attention_mask=attn, position_ids=positions_from_mask(attn),
                    logits_to_keep=keep, use_cache=False)
    logits = out.logits.float()  # (B, keep, V)
    if idx is None:  # aligned: position P-1+t predicts completion token t
        logits = logits[:, :-1]  # (B, T, V)
    else:  # packed: completion token t of row b is predicted at idx[b, t]
        logits = logits.gather(1, idx[..., None].expand(-1, -1, logits.size(-1)))  # (B, T, V)
    if temperature != 1.0:
        logits = logits / temperature
    return token_logps(logits, completion_ids, with_entropy=with_entropy)


def token_logps(logits: torch.Tensor, targets: torch.Tensor, *, with_entropy: bool = False):
    """log softmax(logits)[target] = logit - logsumexp, and optionally the entropy (no gradient).
    logits (..., V), targets (...) -> (...), (...) or None."""
    token_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (...)
    lse = logits.logsumexp(-1)  # (...)
    entropy = None
    if with_entropy:
        with torch.no_grad():
            entropy = lse - (logits.softmax(-1) * logits).sum(-1)  # (...)
    return token_logits - lse, entropy


def _layout(model, prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Choose the cheaper of two equivalent layouts -> (ids, mask, logits_to_keep, gather index or None).

    aligned: [left-padded prompt | right-padded completion], width P+T, logits for the last T+1.
    packed:  each row's prompt+completion moved left, width = longest real row, but logits from the
             earliest completion start, so uneven prompts widen the vocabulary projection.
    The estimate weighs transformer width against lm_head positions using the model's config."""
    T, P = completion_ids.size(1), prompt_ids.size(1)
    ids, attn, start = pack_left(prompt_ids, prompt_mask, completion_ids, completion_mask)  # (B, L)
    first = int(start.min())  # the earliest completion position over the batch
    if first < 1:
        raise ValueError("every prompt needs at least one token")
    keep = ids.size(1) - first + 1  # logits for positions first-1 .. L-1
    if not prefer_packed(getattr(model, "config", None), ids.size(1), keep, P, T):
        return torch.cat([prompt_ids, completion_ids], 1), torch.cat([prompt_mask, completion_mask], 1), T + 1, None
    idx = ((start - first)[:, None] + torch.arange(T, device=ids.device)[None]).clamp(max=keep - 1)  # (B, T)
    return ids, attn, keep, idx


def prefer_packed(config, width: int, keep: int, P: int, T: int) -> bool:
    """Is the packed layout (width, keep) cheaper than the aligned one (P+T, T+1)? Multiply-adds per
    position: the decoder's projections vs the lm_head, from the model config when it has them."""
    H, V = getattr(config, "hidden_size", 0), getattr(config, "vocab_size", 0)
    layers, inter = getattr(config, "num_hidden_layers", 0), getattr(config, "intermediate_size", 4 * H)
    body, head = layers * (4 * H * H + 3 * H * inter), H * V
    if not (body and head):
        return keep <= T + 1
    # packing costs a sort and a gather of the logits: take it only when it saves a tenth or more
    return width * body + keep * head < 0.9 * ((P + T) * body + (T + 1) * head)


def pack_left(prompt_ids, prompt_mask, completion_ids, completion_mask):
    """Move each row's real tokens (prompt then completion) to the left, padding to the right.
    Returns ids (B, L), mask (B, L) with L the longest real row, and prompt lengths (B,)."""
    ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (B, P+T)
    mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (B, P+T)
    order = torch.sort((mask == 0).to(torch.int8), dim=1, stable=True).indices  # real first, order kept
    ids, mask = ids.gather(1, order), mask.gather(1, order)
    width = max(1, int(mask.sum(1).max()))
    return ids[:, :width], mask[:, :width], prompt_mask.sum(1)


def microbatches(n: int, size: int) -> list[slice]:
    return [slice(i, min(i + size, n)) for i in range(0, n, size)]
