"""Correcting for the engine that sampled: importance weights between the trainer's policy and the
sampler's (vLLM's) distribution of the same weights.

A rollout engine and the trainer compute the same policy with different kernels, so the tokens
were drawn from mu (the engine's distribution) while the loss assumes pi_old (the trainer's, at
the weights that sampled). Truncated importance sampling (TIS, Yao et al. 2025, "Your efficient
RL framework secretly brings you off-policy RL training") and its masked variant (MIS) reweight
each token, or each sequence, by pi_old / mu:

    token:     rho_{i,t} = exp(log pi_old(o_t) - log mu(o_t))                    (B, T)
    sequence:  rho_i     = exp(sum_t m_{i,t} (log pi_old(o_t) - log mu(o_t)))    (B, 1)
    *_truncate: w = clamp(rho, C_min, C_max)
    *_mask:     w = rho where C_min <= rho <= C_max, else 0

The per-token policy loss is multiplied by w (before the KL term), as TRL 1.16 does with
`vllm_importance_sampling_correction`. A token without a comparison gets a difference of 0, so
its weight is 1: its behaviour log-prob is NaN (the engine gave none), or the trainer's filter
drops it (log pi_old = -inf: at a top-k/top-p boundary the engine's rounding kept the token, the
trainer's did not; a weight of 0 would drop a whole sequence in the sequence modes).
"""
from __future__ import annotations

import math

import torch

from preftune.losses.names import VLLM_IS_MODES as IS_MODES


def importance_weights(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor, *,
                       mode: str = "sequence_mask", clip_min: float | None = None,
                       clip_max: float | None = 3.0) -> torch.Tensor:
    """w of the module docstring: (B, T) for token modes, (B, 1) for sequence modes.
    old_logps: the trainer's log-probs at the sampling weights (B, T); sampling_logps: the
    engine's (B, T); mask (B, T) 1 for counted tokens. No gradient flows through w."""
    if mode not in IS_MODES:
        raise ValueError(f"unknown importance sampling mode {mode!r}; expected one of "
                         f"{', '.join(IS_MODES)}")
    compared = _compared(old_logps, sampling_logps, mask)  # (B, T)
    diff = torch.where(compared, old_logps.detach() - sampling_logps, 0.0)  # (B, T)
    if mode.startswith("sequence"):
        diff = diff.sum(-1, keepdim=True)  # (B, 1)
    rho = torch.exp(diff)
    if mode.endswith("truncate"):
        return (
            rho.clamp(min=clip_min, max=clip_max)
            if clip_min is not None or clip_max is not None
            else rho
        )
    lo = -math.inf if clip_min is None else clip_min
    hi = math.inf if clip_max is None else clip_max
    return rho.masked_fill((rho < lo) | (rho > hi), 0.0)


def mismatch_stats(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                   weights: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums and extremes for TRL's metrics `sampling/sampling_logp_difference/{mean,max}` and
    `sampling/importance_sampling_ratio/{min,mean,max}` (0-dim tensors; a caller adds sums and
    counts over micro-batches and ranks, then divides). The ratio is over counted tokens for token
    modes, over rows for sequence modes."""
    counted = _compared(old_logps, sampling_logps, mask)  # (B, T)
    delta = (old_logps.detach() - sampling_logps).abs()[counted]  # (n,)
    flat = weights.flatten() if weights.size(-1) == 1 else weights[mask.bool()]
    zero = delta.new_zeros(())
    return {"diff_sum": delta.sum(), "diff_count": delta.new_tensor(float(delta.numel())),
            "diff_max": delta.max() if delta.numel() else zero,
            "ratio_sum": flat.sum(), "ratio_count": flat.new_tensor(float(flat.numel())),
            "ratio_min": flat.min() if flat.numel() else flat.new_full((), math.inf),
            "ratio_max": flat.max() if flat.numel() else flat.new_full((), -math.inf)}


def _compared(old_logps: torch.Tensor, sampling_logps: torch.Tensor,
              mask: torch.Tensor) -> torch.Tensor:
    """Counted tokens with both log-probs finite (B, T) bool."""
    return mask.bool() & torch.isfinite(old_logps.detach()) & ~torch.isnan(sampling_logps)


def turn_index(tool_mask: torch.Tensor) -> torch.Tensor:
    """(B, T) long: which assistant turn each completion token belongs to (0 = the first). A turn
    starts at a sampled token (tool_mask 1) that follows a tool token (0); a tool turn's tokens
    keep the index of the turn before them."""
    starts = (tool_mask[:, 1:] > tool_mask[:, :-1]).long()  # (B, T-1)
    return torch.cat([starts.new_zeros(starts.size(0), 1), starts.cumsum(1)], dim=1)  # (B, T)


def turn_mismatch(old_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                  tool_mask: torch.Tensor, turns: int) -> torch.Tensor:
    """(turns, 2): per assistant turn k, the summed |log pi_old - log mu| over its compared tokens
    and their count (a caller sums over micro-batches and ranks, then divides). Turns past the
    last slot count in it. A per-turn mean that grows with k is the signature of a rollout whose
    later turns were re-tokenized rather than continued from the sampled ids.

    old_logps, sampling_logps, mask, tool_mask: (B, T)."""
    counted = _compared(old_logps, sampling_logps, mask)  # (B, T)
    delta = torch.where(counted, (old_logps.detach() - sampling_logps).abs(), 0.0)  # (B, T)
    turn = turn_index(tool_mask).clamp(max=turns - 1)  # (B, T)
    out = delta.new_zeros(turns, 2)
    out[:, 0].scatter_add_(0, turn.flatten(), delta.flatten())
    out[:, 1].scatter_add_(0, turn.flatten(), counted.flatten().to(delta.dtype))
    return out
