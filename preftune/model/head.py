"""The vocabulary projection and the log-probabilities of target tokens, without (K, V) logits kept.

log p(y) = (h·W_y)/tau - logsumexp_v((h·W_v)/tau) needs every logit of a position, but not all
positions' logits at once: `head_logps` projects CHUNK_ELEMENTS logits at a time, keeps only the
log-sum-exp per position for the backward and recomputes each chunk's logits there,

    d/dlogit_v = g * (1[v = y] - softmax_v) / tau,   dh = dlogits · W,   dW = dlogits^T · h,

so peak memory holds one chunk of logits instead of (K, V) logits, their log-sum-exp input and
their gradient: with a 150k vocabulary and 8k completion tokens that is 5 GB of float32 logits and
as much again for their gradient. Small projections run unchunked, exactly as before.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# logits per chunk (128 MB in float32: ~220 rows of a 150k vocabulary, 1k of 32k)
CHUNK_ELEMENTS = 1 << 25
STATS = ("entropy", "mean_logit", "top1", "log_sum_sq_probs")  # `token_stats`' columns


def head_logps(hidden: torch.Tensor, head, targets: torch.Tensor, *, temperature: float = 1.0,
               with_entropy: bool = False, top_k: int = 0, top_p: float = 1.0,
               stats: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (...,) of `targets` (...,) and optionally the entropy (no gradient), from hidden
    states (..., H) and the output layer `head` (an nn.Linear without bias is chunked). With
    `top_k`/`top_p` the log-probs are the sampler's: softmax over the kept tokens (`filter_logits`).
    `stats`: instead of the entropy, every column of `token_stats` (..., 4)."""
    if top_k or top_p < 1.0:
        return sampling_logps(hidden, head, targets, temperature, top_k, top_p), None
    weight = getattr(head, "weight", None)
    V = weight.size(0) if weight is not None else 0
    rows = hidden[..., 0].numel()
    plain = type(head) is not torch.nn.Linear or head.bias is not None or rows * V <= CHUNK_ELEMENTS
    if plain:
        logits = upcast_logits(head(hidden))  # (..., V)
        if temperature != 1.0:
            logits = logits / temperature
        return token_logps(logits, targets, with_entropy=with_entropy, stats=stats)
    chunk = max(1, CHUNK_ELEMENTS // V)
    flat = hidden.reshape(rows, hidden.size(-1))  # (K, H)
    extra = 2 if stats else int(with_entropy)
    logps, more = _ChunkedHead.apply(flat, weight, targets.reshape(rows), temperature, chunk, extra)
    if not extra:
        return logps.view(targets.shape), None
    return logps.view(targets.shape), more.view(*targets.shape, len(STATS)) if stats else more.view(
        targets.shape
    )


class _ChunkedHead(torch.autograd.Function):
    """(K, H) hidden, (V, H) weight, (K,) targets -> (K,) log-probs and, not differentiable, per
    `extra`: 0 nothing (zeros), 1 the entropy (K,), 2 every column of `token_stats` (K, 4)."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, temperature, chunk, extra):
        K = hidden.size(0)
        logps = hidden.new_empty(K, dtype=torch.promote_types(hidden.dtype, torch.float32))  # (K,)
        lse = torch.empty_like(logps)
        # (K, 4) or (K,)
        entropy = logps.new_zeros(K, len(STATS)) if extra == 2 else torch.zeros_like(logps)
        for s in range(0, K, chunk):
            logits = _logits(hidden[s:s + chunk], weight, temperature)  # (c, V)
            lse[s:s + chunk] = logits.logsumexp(-1)  # (c,)
            logps[s:s + chunk] = logits.gather(1,
                                               targets[s:s + chunk,
                                                       None]).squeeze(1) - lse[s:s + chunk]
            if extra == 2:
                entropy[s:s + chunk] = token_stats(logits, targets[s:s + chunk], lse[s:s + chunk])
            elif extra:
                entropy[s:s + chunk] = lse[s:s + chunk] - (logits.softmax(-1) * logits).sum(-1)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk = temperature, chunk
        ctx.amp = (hidden.device.type, torch.is_autocast_enabled(hidden.device.type),
                   torch.get_autocast_dtype(hidden.device.type))
        ctx.mark_non_differentiable(entropy)
        return logps, entropy

    @staticmethod
    def backward(ctx, grad, _):
        hidden, weight, targets, lse = ctx.saved_tensors
        device, enabled, dtype = ctx.amp
        d_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        d_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        with torch.autocast(device, dtype=dtype, enabled=enabled):  # the forward's precision
            for s in range(0, hidden.size(0), ctx.chunk):
                h, g = hidden[s:s + ctx.chunk], grad[s:s + ctx.chunk]
                # (c, V) softmax
                probs = (_logits(h, weight, ctx.temperature) - lse[s:s + ctx.chunk, None]).exp_()
                d_logits = probs.mul_(-g[:, None])
                d_logits[torch.arange(h.size(0), device=h.device), targets[s:s + ctx.chunk]] += g
                # (c, V)
                d_logits = (d_logits if ctx.temperature == 1.0 else d_logits / ctx.temperature).to(
                    h.dtype
                )
                if d_hidden is not None:
                    d_hidden[s:s + ctx.chunk] = d_logits @ weight.to(d_logits.dtype)  # (c, H)
                if d_weight is not None and not enabled and d_logits.dtype == weight.dtype:
                    d_weight.addmm_(d_logits.t(), h)  # (V, H), accumulated in place
                elif d_weight is not None:  # bf16 products under autocast, float32 master gradient
                    d_weight += (d_logits.t() @ h.to(d_logits.dtype)).to(weight.dtype)
        return d_hidden, d_weight, None, None, None, None


def _logits(hidden: torch.Tensor, weight: torch.Tensor, temperature: float) -> torch.Tensor:
    """(c, H) x (V, H) -> (c, V) logits, at least float32, divided by the temperature."""
    logits = upcast_logits(F.linear(hidden, weight))  # (c, V)
    return logits if temperature == 1.0 else logits / temperature

@torch.no_grad()
def sampling_logps(hidden: torch.Tensor, head, targets: torch.Tensor,
                   temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """log of the distribution a sampler draws from with temperature, top-k and top-p: the
    softmax of logits/T over the tokens `filter_logits` keeps (-inf for a target it drops).
    Row chunks of CHUNK_ELEMENTS logits; no gradient (it is a behaviour policy, not a loss term)."""
    flat, tgt = hidden.reshape(-1, hidden.size(-1)), targets.reshape(-1)  # (K, H), (K,)
    V = getattr(head, "weight", hidden.new_empty(1, 1)).size(0)
    chunk, out = max(1, CHUNK_ELEMENTS // max(V, 1)), []
    for s in range(0, flat.size(0), chunk):
        # (c, V)
        logits = filter_logits(upcast_logits(head(flat[s:s + chunk])) / temperature, top_k, top_p)
        out.append(token_logps(logits, tgt[s:s + chunk])[0])  # (c,)
    return (
        torch.cat(out).view(targets.shape)
        if out
        else flat.new_zeros(targets.shape, dtype=torch.float32)
    )


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


def upcast_logits(logits: torch.Tensor) -> torch.Tensor:
    """At least float32 for the log-softmax (bf16 logits are upcast; float64 stays float64)."""
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


@torch.no_grad()
def token_stats(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Per position, no gradient, the columns of STATS: the entropy lse - sum_v p_v z_v; the mean
    logit over the vocabulary (TRL's `logits/*`); 1 where the target is the argmax (TRL's
    `mean_token_accuracy`); log sum_v p_v^2 = logsumexp(2 z) - 2 lse (WPO's weight,
    arXiv:2406.11827). logits (..., V), targets (...), lse (...) -> (..., 4)."""
    entropy = lse - (torch.softmax(logits, -1) * logits).sum(-1)  # (...)
    top1 = (logits.argmax(-1) == targets).to(logits.dtype)  # (...)
    log_sum_sq = torch.logsumexp(2 * logits, -1) - 2 * lse  # (...)
    return torch.stack([entropy, logits.mean(-1), top1, log_sum_sq], -1)  # (..., 4)


def token_logps(logits: torch.Tensor, targets: torch.Tensor, *,
                with_entropy: bool = False, stats: bool = False):
    """log softmax(logits)[target] = logit - logsumexp, and optionally the entropy (no gradient),
    or with `stats` every column of `token_stats`. logits (..., V), targets (...) -> (...), (...)
    or (..., 4) or None."""
    token_logits = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (...)
    lse = logits.logsumexp(-1)  # (...)
    entropy = None
    if stats:
        entropy = token_stats(logits, targets, lse)
    elif with_entropy:
        with torch.no_grad():
            entropy = lse - (logits.softmax(-1) * logits).sum(-1)  # (...)
    return token_logits - lse, entropy
