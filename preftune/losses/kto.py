"""KTO on unpaired, labeled responses (pure functions, TRL 1.16 `KTOTrainer` semantics).

Kahneman-Tversky Optimisation: Ethayarajh et al. 2024, "KTO: Model Alignment as Prospect Theoretic
Optimization", arXiv:2402.01306. Each response is desirable or undesirable on its own; no pairs.

Per response i of a batch of B (prompt x_i, completion y_i), log π summed over completion tokens:
    r_i = log π(y_i | x_i) - log π_ref(y_i | x_i)
    z   = max(0, mean_j [log π(y'_j | x_j) - log π_ref(y'_j | x_j)])      (detached)
z is the reference point of Eq. 7, an estimate of KL(π || π_ref) from mismatched pairs (x_j, y'_j):
completions of the same batch paired with another prompt, as TRL builds them, (x_1, y_B), (x_2,
y_1), ..., (x_B, y_{B-1}). With σ the logistic function, β > 0, weights λ_D, λ_U:
    kto                desirable: λ_D (1 - σ(β (r_i - z)))   undesirable: λ_U (1 - σ(β (z - r_i)))
    apo_zero_unpaired  desirable: λ_D (1 - σ(β r_i))         undesirable: λ_U σ(β r_i)
                       (the unpaired APO-zero, D'Oosterlinck et al. 2024, arXiv:2408.06266 Eq. 7;
                       no z)
    L = (1/B) Σ_i ℓ_i, over both labels (TRL's `losses.nanmean()`).
z is a constant of the step (detached), so a batch split into micro-batches or over ranks gives the
same update when z is taken over the whole batch (`kto_reference_point` of the summed log-ratios)
and each part divides its summed losses by the whole batch's B (`normaliser`). TRL averages each
rank's z over the ranks (`gather_for_metrics(kl).mean()`): the same with equal shares, as here.
"""
from __future__ import annotations

import torch

from preftune.losses.names import KTO_LOSS_TYPES


def kto_reference_point(logratio_sum: torch.Tensor, count: int) -> torch.Tensor:
    """z = max(0, Σ_j (log π(y'_j|x_j) - log π_ref(y'_j|x_j)) / count), detached: the summed
    log-ratios of `count` mismatched pairs (summed over ranks and micro-batches by the caller)."""
    return (logratio_sum.detach() / max(count, 1)).clamp(min=0)


def _check(logps, ref_logps, labels, beta: float, loss_type: str) -> None:
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"unknown KTO loss type {loss_type!r}; expected one of "
                         f"{', '.join(KTO_LOSS_TYPES)}")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta}")
    if labels.dtype != torch.bool:
        raise ValueError(f"labels must be a bool tensor (True = desirable), got {labels.dtype}")
    if not (logps.shape == ref_logps.shape == labels.shape) or logps.dim() != 1:
        raise ValueError(f"logps, ref_logps and labels must be (B,), got {tuple(logps.shape)}, "
                         f"{tuple(ref_logps.shape)}, {tuple(labels.shape)}")


def kto_loss(logps: torch.Tensor, ref_logps: torch.Tensor, labels: torch.Tensor,
             kl_logps: torch.Tensor | None,
             ref_kl_logps: torch.Tensor | None, *, beta: float = 0.1, desirable_weight: float = 1.0,
             undesirable_weight: float = 1.0, loss_type: str = "kto",
             kl: torch.Tensor | None = None,
             normaliser: float | None = None, counts: tuple[int, int] | None = None,
             sync_metrics: bool = True) -> tuple[torch.Tensor, dict]:
    """The KTO loss of B labeled responses (formulas and papers in the module docstring).

    logps, ref_logps: (B,) summed completion log-probs under the policy (carries gradients) and the
    reference. labels: (B,) bool, True = desirable. kl_logps, ref_kl_logps: (M,) the same for the
    mismatched pairs (TRL's KL_logps; M = B in TRL), giving z; unused by apo_zero_unpaired (pass
    None), or when `kl` brings z computed over a larger batch (`kto_reference_point`). `normaliser`:
    divide the summed losses by it instead of B (a micro-batch's or a rank's share of a larger
    batch), and `counts` (desirable, undesirable) of that batch the metrics' means by
    (`kto_metrics`: then the parts' metrics add up, and nothing is read from the device). Returns
    (scalar loss, metrics) with TRL's names; sync_metrics=False leaves them 0-dim tensors.
    """
    _check(logps, ref_logps, labels, beta, loss_type)
    if loss_type == "apo_zero_unpaired":
        z = logps.new_zeros(())  # TRL computes no KL term for it, and logs kl = 0
    elif kl is not None:
        z = torch.as_tensor(kl, dtype=logps.dtype, device=logps.device).detach()
    elif kl_logps is None or ref_kl_logps is None:
        raise ValueError("loss_type='kto' needs kl_logps and ref_kl_logps (or kl)")
    else:
        z = kto_reference_point((kl_logps - ref_kl_logps).sum(), kl_logps.numel())
    logratios = logps - ref_logps  # (B,) r_i
    if loss_type == "kto":
        desirable, undesirable = (
            1 - torch.sigmoid(beta * (logratios - z)),
            1 - torch.sigmoid(beta * (z - logratios)),
        )
    else:
        desirable, undesirable = (
            1 - torch.sigmoid(beta * logratios),
            torch.sigmoid(beta * logratios),
        )
    # (B,)
    losses = torch.where(labels, desirable_weight * desirable, undesirable_weight * undesirable)
    loss = losses.sum() / (normaliser if normaliser is not None else logps.numel())
    return loss, kto_metrics(logps, ref_logps, labels, z, beta=beta,
                             counts=counts, sync=sync_metrics)


@torch.no_grad()
def kto_metrics(logps: torch.Tensor, ref_logps: torch.Tensor,
                labels: torch.Tensor, z: torch.Tensor, *,
                beta: float, counts: tuple[int, int] | None = None, sync: bool = True) -> dict:
    """TRL's KTO metrics: `kl` (z); `rewards/chosen`, `logps/chosen` (means of β r_i and log π over
    the desirable rows), the same `/rejected` over the undesirable ones, and `rewards/margins`
    (their difference). A label without rows has no metrics, as in TRL. `counts` (desirable,
    undesirable): divide by these instead of this batch's counts, so a rank's partial means add up
    over the ranks."""
    chosen = labels.to(logps.dtype)  # (B,)
    n_chosen, n_rejected = (
        counts if counts is not None else (int(labels.sum()), int((~labels).sum()))
    )
    rewards = beta * (logps - ref_logps)  # (B,)
    sums = torch.stack([(rewards * chosen).sum(), (logps * chosen).sum(),
                        (rewards * (1 - chosen)).sum(),
                        (logps * (1 - chosen)).sum()])  # (4,)
    divisors = torch.tensor([max(n_chosen, 1)] * 2 + [max(n_rejected, 1)] * 2,
                            dtype=sums.dtype, device=sums.device)
    means = list((sums / divisors).unbind()) + [z.reshape(())]
    means = torch.stack(means).tolist() if sync else means  # one device sync for all, or none
    out = {"kl": means[4]}
    if n_chosen:
        out |= {"rewards/chosen": means[0], "logps/chosen": means[1]}
    if n_rejected:
        out |= {"rewards/rejected": means[2], "logps/rejected": means[3]}
    if n_chosen and n_rejected:
        out["rewards/margins"] = means[0] - means[2]
    return out


def weight_advice(n_desirable: int, n_undesirable: int, desirable_weight: float,
                  undesirable_weight: float) -> str | None:
    """TRL's advice when the weighted desirable:undesirable ratio λ_D n_D / (λ_U n_U) is outside
    [1, 4/3] (Eq. 8 of the KTO paper) for both weights: the ranges either weight should be in, else
    None."""
    n_d = max(n_desirable, 1)
    n_u = max(n_desirable + n_undesirable - n_d, 1)  # TRL's counts, including its floor of 1
    if n_d == n_u:
        return None
    d_lo, d_hi = round(n_u * undesirable_weight / n_d,
                       2), round(n_u * undesirable_weight / n_d * 1.33, 2)
    u_lo, u_hi = round(n_d * desirable_weight / n_u / 1.33,
                       2), round(n_d * desirable_weight / n_u, 2)
    if d_lo <= desirable_weight <= d_hi or u_lo <= undesirable_weight <= u_hi:
        return None
    return (f"{n_desirable} desirable and {n_undesirable} undesirable examples: the weighted ratio "
            f"is outside [1, 4/3]; set EITHER kto.desirable_weight in [{d_lo}, {d_hi}] or "
            f"kto.undesirable_weight in [{u_lo}, {u_hi}] (not both)")
