"""GRPO-family policy-gradient losses: GRPO, DAPO, Dr. GRPO, BNPO, GSPO, CISPO, SAPO, LUSPO, VESPO.

`grpo_loss(..., loss_type=...)` keeps TRL's names and signature; inside it, each choice is a
separate piece that can be read and tested on its own:

1. the importance level: the ratio per token, or GSPO's per sequence (`importance_log_ratio`),
2. the surrogate: PPO clip, CISPO, SAPO (`SURROGATE[loss_type]`, `policy_surrogate`) or VESPO's
   gamma weight on REINFORCE (`vespo_weights`),
3. the KL penalty (`k3_kl`),
4. the aggregation: a mean over each sequence's tokens, or a sum over all tokens
   (`AGGREGATION[loss_type]`, `aggregate`), divided by one normaliser (`local_normaliser`, or the
   whole batch's). LUSPO is the clip surrogate with a token sum per sequence and a mean over
   sequences.

A training loop that splits a generation batch into micro-batches (and ranks) passes the whole
batch's normaliser (`batch_normaliser`): every micro-batch's loss is then its exact share, and the
summed gradients equal one pass over the batch. With that normaliser bnpo is dapo: a token sum
over the batch's token count (two names for one update, both TRL's).
"""
from __future__ import annotations

import math

import torch

from preftune.losses.names import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES

SURROGATE = {"grpo": "clip", "bnpo": "clip", "dr_grpo": "clip", "dapo": "clip",
             "cispo": "cispo", "sapo": "sapo", "luspo": "clip", "vespo": "vespo"}
AGGREGATION = {"grpo": "sequence", "sapo": "sequence", "bnpo": "token",
               "dapo": "token", "cispo": "token",
               "dr_grpo": "token", "luspo": "token", "vespo": "token"}
# TRL 1.16's vespo_* defaults
VESPO_DEFAULTS = {"k_pos": 2.0, "lambda_pos": 3.0, "k_neg": 3.0, "lambda_neg": 2.0}
_LOG_W_MIN = math.log(1e-8)  # VESPO's floor on log w (its reference implementation's)


def _check_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {name} {value!r}; expected one of {', '.join(choices)}")


def importance_log_ratio(
    logps: torch.Tensor, old_logps: torch.Tensor, mask: torch.Tensor, level: str
) -> torch.Tensor:
    """Log importance weight log w.

    token:    log w_{i,t} = log pi(o_t) - log pi_old(o_t)                      -> (B, T)
    sequence: log s_i = (1/|o_i|) sum_t m_{i,t} (log pi - log pi_old)           -> (B, 1)
              (GSPO, arXiv:2507.18071: length-normalised sequence likelihood ratio;
              |o_i| is clamped to >= 1 so an all-padding row gives s_i = 1).
    """
    log_ratio = logps - old_logps  # (B, T)
    if level == "token":
        return log_ratio
    seq = (log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)  # (B,)
    return seq.unsqueeze(-1)  # (B, 1)


def policy_surrogate(
    log_w: torch.Tensor,
    logps: torch.Tensor,
    advantages: torch.Tensor,
    surrogate: str,
    *,
    epsilon_low: float,
    epsilon_high: float,
    delta: float | None,
    sapo_temperature_pos: float,
    sapo_temperature_neg: float,
) -> torch.Tensor:
    """Per-token policy loss (to be minimised), before KL and aggregation. r = exp(log_w).

    clip (grpo, bnpo, dr_grpo, dapo), PPO clip with DAPO's decoupled "clip-higher" bounds
    (arXiv:2503.14476) and INTELLECT-2's two-sided clip delta (arXiv:2505.07291):
        l = -min(min(r, delta) * A, clip(r, 1 - eps_low, 1 + eps_high) * A)
    cispo (MiniMax-M1, arXiv:2506.13585), a truncated, stop-gradient IS weight on REINFORCE:
        l = -sg[min(r, eps_high)] * A * log pi      (eps_high is the absolute cap eps_max here)
    sapo (arXiv:2511.20347), a smooth gate instead of a hard clip, tau by the sign of A:
        l = -(4 / tau) * sigmoid(tau * (r - 1)) * A,  tau = tau_pos if A > 0 else tau_neg
    Shapes: log_w (B, T) or (B, 1); advantages (B, 1); result broadcasts to log_w's shape.
    """
    ratio = torch.exp(log_w)  # (B, T) or (B, 1)
    if surrogate == "cispo":
        weight = torch.clamp(ratio, max=epsilon_high).detach()
        return -weight * advantages * logps  # (B, T)
    if surrogate == "sapo":
        pos, neg = (advantages.new_tensor(t) for t in (sapo_temperature_pos, sapo_temperature_neg))
        tau = torch.where(advantages > 0, pos, neg)  # (B, 1)
        return -torch.sigmoid(tau * (ratio - 1)) * (4 / tau) * advantages
    clipped = torch.clamp(ratio, 1 - epsilon_low, 1 + epsilon_high)
    unclipped = ratio if delta is None else torch.clamp(ratio, max=delta)
    return -torch.min(unclipped * advantages, clipped * advantages)


def k3_kl(logps: torch.Tensor, ref_logps: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator of KL(pi || pi_ref) (Schulman 2020; GRPO eq. 4, arXiv:2402.03300):

        k3 = exp(ref - logp) - (ref - logp) - 1  >= 0, unbiased for samples from pi.
    """
    d = ref_logps - logps  # (B, T)
    return torch.exp(d) - d - 1


@torch.no_grad()
def vespo_weights(log_ratio: torch.Tensor, mask: torch.Tensor, advantages: torch.Tensor, *,
                  k_pos: float, lambda_pos: float, k_neg: float, lambda_neg: float,
                  importance_weights: torch.Tensor | None = None) -> torch.Tensor:
    """VESPO's per-sequence weight phi (arXiv:2602.10693), a smooth gamma-shaped gate on the
    sequence importance ratio w instead of a hard clip; no gradient flows through it:

        log w_i = clamp(sum_t m (clamp(log pi - log pi_old, -20, 20) + log rho_t), log 1e-8, 20)
        phi_i   = exp(lambda + k log w_i - lambda w_i)   (= 1 at w = 1),
        k, lambda by the sign of A_i (A >= 0: pos)

    rho_t: the sampling engine's per-token importance weights (folded into w here, not multiplied
    into the loss; each log clamped to [log 1e-8, 20]). The loss is then -phi_i * A_i * log pi
    (REINFORCE scaled by phi). log_ratio, mask: (B, T); advantages: (B, 1) -> phi (B, 1)."""
    seq = (log_ratio.clamp(-20.0, 20.0) * mask).sum(-1, keepdim=True)  # (B, 1)
    if importance_weights is not None:
        log_rho = torch.log(importance_weights).clamp(_LOG_W_MIN, 20.0)  # (B, T) or (B, 1)
        seq = (
            seq + (log_rho * mask).sum(-1, keepdim=True) if log_rho.shape[-1] > 1 else seq + log_rho
        )
    log_w = seq.clamp(_LOG_W_MIN, 20.0)  # (B, 1)
    nonneg = advantages >= 0
    k = torch.where(nonneg, k_pos, k_neg).to(log_w.dtype)  # (B, 1)
    lam = torch.where(nonneg, lambda_pos, lambda_neg).to(log_w.dtype).clamp(min=1e-4)  # (B, 1)
    phi = torch.exp(lam + k * log_w - lam * torch.exp(log_w))  # (B, 1)
    return phi.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)


def aggregate(per_token_loss: torch.Tensor, mask: torch.Tensor, how: str,
              normaliser) -> torch.Tensor:
    """Reduce masked per-token terms l_{i,t} (m = mask) to a scalar, divided by `normaliser` N:

    sequence (GRPO, arXiv:2402.03300; SAPO):  sum_i [sum_t m l / max(|o_i|, 1)] / N
    token    (DAPO, arXiv:2503.14476; BNPO; Dr. GRPO; CISPO; VESPO; LUSPO):  sum_i sum_t m l / N
    """
    masked = per_token_loss * mask  # (B, T)
    if how == "sequence":
        return (masked.sum(-1) / mask.sum(-1).clamp(min=1.0)).sum() / normaliser
    return masked.sum() / normaliser


def local_normaliser(loss_type: str, mask: torch.Tensor, *, num_items=None,
                     max_completion_length: int | None = None):
    """The aggregation's divisor for this (micro-)batch alone, TRL's rule per loss type (B rows):

        grpo, sapo:   B  (a mean over sequences)
        luspo:        B  (a mean over sequences of each one's token sum: LUSPO, arXiv:2602.05261)
        bnpo:         max(sum m, 1)  (a token mean over this batch)
        dapo, cispo, vespo:  max(num_items, 1), num_items = the whole generation batch's tokens
                  (default sum m)
        dr_grpo:      B * L_max, L_max = max_completion_length (default T; pass the configured
                      maximum so micro-batches agree; arXiv:2503.20783)"""
    rows = mask.shape[0]
    if loss_type in ("grpo", "sapo", "luspo"):
        return rows
    if loss_type == "dr_grpo":
        return rows * (mask.shape[-1] if max_completion_length is None else max_completion_length)
    tokens = mask.sum() if loss_type == "bnpo" or num_items is None else \
        torch.as_tensor(num_items, dtype=mask.dtype, device=mask.device)
    return tokens.clamp(min=1.0)


def batch_normaliser(loss_type: str, *, batch_seqs: int, batch_tokens: float,
                     max_completion_length: int) -> float:
    """The normaliser of a whole generation batch (sequences and unmasked completion tokens of every
    micro-batch and rank): with it each micro-batch's `grpo_loss` is its share of the batch's loss,
    so losses and gradients summed over micro-batches and ranks equal one pass over the batch
    (ranks then SUM gradients). bnpo's token mean over the batch is dapo's normaliser."""
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    if AGGREGATION[loss_type] == "sequence" or loss_type == "luspo":
        return float(batch_seqs)
    if loss_type == "dr_grpo":
        return float(batch_seqs * max_completion_length)
    return max(float(batch_tokens), 1.0)


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Token mean for (B, T) values; for (B, 1) sequence values, the mean over all B rows."""
    if x.shape[-1] == 1:
        return x.to(mask.dtype).mean()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def _row_fractions(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-sequence fraction of flagged tokens (NaN for an all-padding row)."""
    if x.shape[-1] == 1:
        return x.squeeze(-1).to(mask.dtype)  # (B,)
    return (x * mask).sum(-1) / mask.sum(-1)  # (B,)


def _nan_extreme(x: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (or min) ignoring NaN; NaN if all are NaN. No boolean indexing, so no device sync."""
    fill = -torch.inf if largest else torch.inf
    out = torch.where(torch.isnan(x), fill, x)
    out = out.max() if largest else out.min()
    return torch.where(torch.isinf(out), torch.nan, out)


CLIP_KEYS = ("low_mean", "high_mean", "region_mean", "low_min", "high_max")
# How each metric of `grpo_loss` combines over micro-batches and ranks: these by their extreme;
# those in ROW_MEANS (and GSPO's clip fractions) as means over sequences; every other one as a
# mean over tokens (each part weighted by its share of the whole batch, then summed)
EXTREMES = {"clip_ratio/low_min": min, "clip_ratio/high_max": max}
ROW_MEANS = {"vespo/phi_seq_mean"}


@torch.no_grad()
def _clip_metrics(
    log_w: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, loss_type: str,
    epsilon_low: float, epsilon_high: float,
) -> dict[str, torch.Tensor]:
    """Fraction of tokens (sequences under GSPO) whose ratio sits where the clip has zero gradient.

    low: r < 1 - eps_low with A < 0; high: r > 1 + eps_high with A > 0 (for cispo: r > eps_max
    with A > 0, as TRL's cispo_clip_ratio); region: either. Means are over unmasked tokens;
    low_min / high_max are the extreme per-sequence fractions. sapo and vespo never hard-clip:
    zeros. The raw ratio is used (TRL 1.16 tests it after the delta cap, which differs only if
    delta < 1 + eps_high, against the recommended setting).
    """
    ratio = torch.exp(log_w)  # (B, T) or (B, 1)
    if SURROGATE[loss_type] == "clip":
        low = (ratio < 1 - epsilon_low) & (advantages < 0)
        high = (ratio > 1 + epsilon_high) & (advantages > 0)
    elif SURROGATE[loss_type] == "cispo":
        high = (ratio > epsilon_high) & (advantages > 0)
        low = torch.zeros_like(high)
    else:
        zero = mask.new_zeros(())
        return {f"clip_ratio/{k}": zero for k in CLIP_KEYS}
    low, high = low.to(mask.dtype), high.to(mask.dtype)
    values = (
        _masked_mean(low, mask),
        _masked_mean(high, mask),
        _masked_mean(torch.maximum(low, high), mask),
        _nan_extreme(_row_fractions(low, mask), largest=False),
        _nan_extreme(_row_fractions(high, mask), largest=True),
    )
    return {f"clip_ratio/{k}": v for k, v in zip(CLIP_KEYS, values)}


def _validate(loss_type, importance_sampling_level, beta, ref_logps, epsilon_high,
              logps, advantages, mask):
    _check_choice("loss_type", loss_type, LOSS_TYPES)
    _check_choice("importance_sampling_level", importance_sampling_level,
                  IMPORTANCE_SAMPLING_LEVELS)
    if beta < 0:
        raise ValueError(f"beta must be >= 0, got {beta}")
    if beta > 0 and ref_logps is None:
        raise ValueError("beta > 0 needs ref_logps (the reference model's per-token log-probs)")
    if loss_type == "cispo" and epsilon_high is None:
        # For cispo epsilon_high is an absolute cap on r, so defaulting it to epsilon (0.2) would
        # silently scale every update down 5x. ScaleRL (arXiv:2510.13786) recommends 5.0.
        raise ValueError("loss_type 'cispo' needs epsilon_high "
                         "(the cap eps_max on the ratio, e.g. 5.0)")
    if logps.dim() != 2 or mask.shape != logps.shape:
        raise ValueError("logps and mask must both be (B, T); got "
                         f"{tuple(logps.shape)} and {tuple(mask.shape)}")
    if advantages.shape != logps.shape[:1]:
        raise ValueError(f"advantages must be (B,) = ({logps.shape[0]},); got "
                         f"{tuple(advantages.shape)}")


def grpo_loss(
    logps: torch.Tensor,
    old_logps: torch.Tensor | None,
    ref_logps: torch.Tensor | None,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    loss_type: str = "dapo",
    beta: float = 0.0,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    max_completion_length: int | None = None,
    num_items: float | torch.Tensor | None = None,
    normaliser: float | torch.Tensor | None = None,
    sapo_temperature_pos: float = 1.0,
    sapo_temperature_neg: float = 1.05,
    kl_ratio_correction: bool = False,
    importance_weights: torch.Tensor | None = None,
    vespo: dict[str, float] | None = None,
    sync_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, float] | dict[str, torch.Tensor]]:
    """GRPO-family loss of one (micro-)batch and its metrics.

    logps, old_logps, ref_logps: (B, T) per-token log-probs of the completion tokens under the
    policy (with grad), the sampling policy (None = on-policy: logps.detach(), so r == 1 but
    grad r = grad log pi) and the reference model (needed only when beta > 0).
    advantages: (B,); mask: (B, T), 1 for completion tokens that count.

    loss = aggregate(policy_surrogate(r, A) + beta * k3) / N: `loss_type` picks the surrogate
    (`SURROGATE`: clip, with DAPO clip-higher `epsilon_high` (default epsilon) and the two-sided
    `delta`; CISPO; SAPO) and the aggregation (`AGGREGATION`, `aggregate`) with its normaliser N
    (`local_normaliser`: from num_items and max_completion_length; or `normaliser`,
    a training loop's whole-batch N, `batch_normaliser`); `importance_log_ratio` is the level (token
    ratio, or GSPO's sequence ratio, arXiv:2507.18071, broadcast over tokens); `k3_kl` the KL term.
    kl_ratio_correction: multiply k3 by r (DeepSeek-V3.2, arXiv:2512.02556; TRL 1.16's
    use_bias_correction_kl, on by default there) so its gradient is the unbiased reverse-KL one.
    importance_weights: (B, T) or (B, 1) weights on the policy term, before the KL term
    (`losses/sampling.importance_weights`: the sampling engine's correction, TRL's
    vllm_importance_sampling_correction); None = 1. vespo's surrogate folds them into its weight
    instead (`vespo_weights`, its k and lambda from `vespo`, default `VESPO_DEFAULTS`).

    Metrics (python floats, or 0-dim tensors with sync_metrics=False, so a training loop can read
    all micro-batches' metrics in one host sync at the end of its step): kl (masked mean of the KL
    term actually used, 0.0 when beta == 0)
    and clip_ratio/{low_mean, high_mean, region_mean, low_min, high_max}, see `_clip_metrics`;
    vespo also vespo/phi_seq_mean (the mean of phi over sequences).
    """
    _validate(loss_type, importance_sampling_level, beta, ref_logps, epsilon_high,
              logps, advantages, mask)
    # At least float32: a bf16 mask cannot count past 256 tokens exactly, nor hold ratios near 1.
    dtype = torch.promote_types(logps.dtype, torch.float32)
    logps, mask = logps.to(dtype), mask.to(dtype)
    old_logps = logps.detach() if old_logps is None else old_logps.to(dtype)
    ref_logps = None if ref_logps is None else ref_logps.to(dtype)
    eps_high = epsilon if epsilon_high is None else epsilon_high
    adv = advantages.to(dtype).unsqueeze(-1)  # (B, 1)

    # (B, T) or (B, 1)
    log_w = importance_log_ratio(logps, old_logps, mask, importance_sampling_level)
    extra = {}
    if loss_type == "vespo":
        phi = vespo_weights(
            logps.detach() - old_logps,
            mask,
            adv,
            **(VESPO_DEFAULTS | (vespo or {})),
            importance_weights=None if importance_weights is None else importance_weights.to(dtype),
        )
        per_token = -phi * adv * logps  # (B, T)
        extra["vespo/phi_seq_mean"] = phi.mean()
    else:
        per_token = policy_surrogate(log_w, logps, adv, SURROGATE[loss_type], epsilon_low=epsilon,
                                     epsilon_high=eps_high, delta=delta,
                                     sapo_temperature_pos=sapo_temperature_pos,
                                     sapo_temperature_neg=sapo_temperature_neg)
        if importance_weights is not None:
            per_token = per_token * importance_weights.to(dtype)  # (B, T)
    kl_metric = mask.new_zeros(())
    if beta > 0:
        kl = k3_kl(logps, ref_logps)  # (B, T)
        if kl_ratio_correction:
            kl = kl * torch.exp(log_w)
        per_token = per_token + beta * kl  # (B, T)
        kl_metric = _masked_mean(kl.detach(), mask)
    n = normaliser if normaliser is not None else local_normaliser(
        loss_type, mask, num_items=num_items, max_completion_length=max_completion_length)
    loss = aggregate(per_token, mask, AGGREGATION[loss_type], n)
    metrics = {"kl": kl_metric,
               **_clip_metrics(log_w.detach(), adv, mask, loss_type, epsilon, eps_high), **extra}
    if not sync_metrics:
        return loss, metrics
    values = torch.stack(list(metrics.values())).tolist()  # one device sync for all metrics
    return loss, dict(zip(metrics, values))

