"""DPO-family preference losses on sequence log-probabilities (pure functions, TRL 1.16 semantics).

Notation, per pair i of a batch of B pairs (chosen y_c, rejected y_r):
    Δc = log π(y_c) - log π_ref(y_c)     Δr = log π(y_r) - log π_ref(y_r)     h = Δc - Δr
log π is summed over completion tokens; |y| is the completion token count (clamped to >= 1);
σ is the logistic function, β > 0 the temperature, ε the label smoothing. Reference-free
(`ref_* = None`) sets log π_ref = 0.

Per-pair losses ℓ_i; the loss of a type is mean_i ℓ_i:
  sigmoid       -log σ(β h)                                      DPO, arXiv:2305.18290
  hinge         max(0, 1 - β h)                                  SLiC, arXiv:2305.10425
  ipo           (Δc/|y_c| - Δr/|y_r| - 1/(2β))²                  IPO, arXiv:2310.12036 Eq. 17
                (length-normalised as in TRL 1.16; β plays the paper's τ)
  sigmoid_norm  -log σ(β (Δc/|y_c| - Δr/|y_r|))                  DPO on per-token average log-ratios
                (the length-normalised reward of SimPO, arXiv:2405.14734, kept relative to π_ref)
  robust        [-(1-ε) log σ(β h) + ε log σ(-β h)] / (1 - 2ε)   rDPO, arXiv:2403.00409
                (needs ε in [0, 0.5))
  exo_pair      σ(βh)(log σ(βh) - log(1-ε)) + σ(-βh)(log σ(-βh) - log ε)
                                                                 EXO, arXiv:2402.00856 Eq. 16
                (needs ε in (0, 1))
  nca_pair      -log σ(βΔc) - ½ log σ(-βΔc) - ½ log σ(-βΔr)      NCA, arXiv:2402.05369
  bco_pair      -log σ(βΔc) - log σ(-βΔr)                        BCO, arXiv:2404.04656
                (without BCO's running reward shift)
  sppo_hard     (Δc - 1/(2β))² + (Δr + 1/(2β))²                  SPPO, arXiv:2405.00675
                (the hard preference P = 1 / 0)
  apo_zero      1 - σ(βΔc) + σ(βΔr)                              APO, arXiv:2408.06266 Eq. 7
  apo_down      σ(βΔc) + 1 - σ(β h)                              APO, arXiv:2408.06266 Eq. 8
  discopop      (1-m)(-log σ(βh)) + m exp(-βh),  m = σ(βh/τ), τ = DISCOPOP_TAU
                                                                 DiscoPOP, arXiv:2406.08414 Eq. 5
Batch-level types (NOT a mean of independent per-pair terms; see BATCH_LEVEL):
  aot           ℓ_(k) = -(1-ε) log σ(β d_k) - ε log σ(-β d_k)          AOT, arXiv:2406.05882
                d = sort(log π(y_c) - log π(y_r)) - sort(log π_ref(y_c) - log π_ref(y_r)),
                sorted over the batch
  aot_unpaired  as aot with d = sort(Δc) - sort(Δr)
  sft           -Σ_i log π(y_c,i) / Σ_i |y_c,i|: mean NLL over all chosen tokens of the batch
                (the NLL term of RPO, arXiv:2404.19733; combine it with sigmoid via dpo_loss_multi)

WPO weighting (`wpo_weights`, TRL's use_weighting): each pair's ℓ_i is multiplied by w(y_c) w(y_r)
before the mean (not for aot/aot_unpaired, whose terms are sorted across pairs).

Gradient accumulation: for the per-pair types, a micro-batch of b of the B pairs weighted by b/B
gives exactly the full-batch loss and gradients. For the BATCH_LEVEL types the sort (aot*) or the
token mean (sft) runs within each micro-batch, so the accumulated loss is Σ_k (b_k/B) L(micro-batch
k), which equals the full-batch loss only when the micro-batch is the whole batch (sft: also when
all |y_c| are equal). TRL's trainer has the same behaviour under its gradient accumulation.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from preftune.errors import UserError
from preftune.losses.names import DPO_LOSS_TYPES

DISCOPOP_TAU = 0.05  # TRL 1.16's default discopop_tau, the paper's recommended value
LOSS_TYPES = DPO_LOSS_TYPES
BATCH_LEVEL = frozenset({"aot", "aot_unpaired", "sft"})
NEEDS_LENGTHS = {"ipo": ("chosen", "rejected"),
                 "sigmoid_norm": ("chosen", "rejected"), "sft": ("chosen",)}
USES_LABEL_SMOOTHING = frozenset({"robust", "exo_pair", "aot", "aot_unpaired"})


class DPOOptionError(UserError, ValueError):
    """A bad DPO option; a ValueError for library callers, a UserError naming the `dpo.*` key for
    the CLI."""


def check_dpo_options(loss_types: Sequence[str], loss_weights: Sequence[float] | None, beta: float,
                      label_smoothing: float) -> None:
    """Validate DPO options (also usable by config validation); raises DPOOptionError naming the
    key."""
    if isinstance(loss_types, str) or len(loss_types) == 0:
        raise DPOOptionError(f"expected a non-empty list of loss types, got {loss_types!r}",
                             where="dpo.loss_type")
    for loss_type in loss_types:
        if loss_type not in LOSS_TYPES:
            raise DPOOptionError(f"unknown loss type {loss_type!r}; valid: {', '.join(LOSS_TYPES)}",
                                 where="dpo.loss_type")
    if loss_weights is not None:
        if len(loss_weights) != len(loss_types):
            raise DPOOptionError(f"{len(loss_weights)} weights for {len(loss_types)} loss types",
                                 where="dpo.loss_weights")
        if not all(math.isfinite(w) for w in loss_weights):
            raise DPOOptionError(f"weights must be finite, got {list(loss_weights)}",
                                 where="dpo.loss_weights")
    if not (math.isfinite(beta) and beta > 0):
        raise DPOOptionError(f"must be > 0, got {beta}", where="dpo.beta")
    _check_label_smoothing(loss_types, label_smoothing)


def _check_label_smoothing(loss_types: Sequence[str], eps: float) -> None:
    # TRL 1.16's sigmoid ignores label_smoothing (cDPO moved to `robust`): reject a silently unused
    # value.
    if eps != 0.0 and not USES_LABEL_SMOOTHING.intersection(loss_types):
        raise DPOOptionError(f"{eps} has no effect with loss_type {list(loss_types)}; it is used "
                             f"by {', '.join(sorted(USES_LABEL_SMOOTHING))}",
                             where="dpo.label_smoothing")
    if "robust" in loss_types and not 0.0 <= eps < 0.5:
        raise DPOOptionError(f"robust needs 0 <= label_smoothing < 0.5, got {eps}",
                             where="dpo.label_smoothing")
    if "exo_pair" in loss_types and not 0.0 < eps < 1.0:
        raise DPOOptionError("exo_pair needs 0 < label_smoothing "
                             f"< 1 (the paper uses 1e-3), got {eps}",
                             where="dpo.label_smoothing")
    if not 0.0 <= eps <= 1.0:
        raise DPOOptionError(f"must be in [0, 1], got {eps}", where="dpo.label_smoothing")


class _Pairs:
    """The batch tensors and scalars a per-type loss reads; Δc, Δr, h precomputed once."""

    def __init__(self, chosen, rejected, ref_chosen, ref_rejected, chosen_len,
                 rejected_len, beta, eps):
        self.chosen, self.rejected = chosen, rejected  # (B,), (B,)
        self.ref_chosen, self.ref_rejected = ref_chosen, ref_rejected  # (B,), (B,)
        # (B,) float, clamped >= 1, or None
        self.chosen_len, self.rejected_len = chosen_len, rejected_len
        self.beta, self.eps = beta, eps
        self.dc = chosen - ref_chosen  # (B,) chosen log-ratio Δc
        self.dr = rejected - ref_rejected  # (B,) rejected log-ratio Δr
        self.h = self.dc - self.dr  # (B,)


def _smoothed_sigmoid(z: torch.Tensor, eps: float) -> torch.Tensor:
    return -(1 - eps) * F.logsigmoid(z) - eps * F.logsigmoid(-z)


def _sigmoid(p: _Pairs) -> torch.Tensor:
    return -F.logsigmoid(p.beta * p.h)


def _hinge(p: _Pairs) -> torch.Tensor:
    return torch.relu(1 - p.beta * p.h)


def _norm_margin(p: _Pairs) -> torch.Tensor:
    return p.dc / p.chosen_len - p.dr / p.rejected_len  # (B,) per-token average log-ratio margin


def _ipo(p: _Pairs) -> torch.Tensor:
    return (_norm_margin(p) - 1 / (2 * p.beta)) ** 2


def _sigmoid_norm(p: _Pairs) -> torch.Tensor:
    return -F.logsigmoid(p.beta * _norm_margin(p))


def _robust(p: _Pairs) -> torch.Tensor:
    z = p.beta * p.h
    return (-(1 - p.eps) * F.logsigmoid(z) + p.eps * F.logsigmoid(-z)) / (1 - 2 * p.eps)


def _exo_pair(p: _Pairs) -> torch.Tensor:
    # KL(softmax over {chosen, rejected} of β·log-ratio || [1-ε, ε]), expanded for two outcomes.
    z = p.beta * p.h
    kl_chosen = torch.sigmoid(z) * (F.logsigmoid(z) - math.log1p(-p.eps))
    kl_rejected = torch.sigmoid(-z) * (F.logsigmoid(-z) - math.log(p.eps))
    return kl_chosen + kl_rejected


def _nca_pair(p: _Pairs) -> torch.Tensor:
    zc, zr = p.beta * p.dc, p.beta * p.dr
    return -F.logsigmoid(zc) - 0.5 * F.logsigmoid(-zc) - 0.5 * F.logsigmoid(-zr)


def _bco_pair(p: _Pairs) -> torch.Tensor:
    return -F.logsigmoid(p.beta * p.dc) - F.logsigmoid(-p.beta * p.dr)


def _sppo_hard(p: _Pairs) -> torch.Tensor:
    return (p.dc - 0.5 / p.beta) ** 2 + (p.dr + 0.5 / p.beta) ** 2


def _apo_zero(p: _Pairs) -> torch.Tensor:
    return 1 - torch.sigmoid(p.beta * p.dc) + torch.sigmoid(p.beta * p.dr)


def _apo_down(p: _Pairs) -> torch.Tensor:
    return torch.sigmoid(p.beta * p.dc) + 1 - torch.sigmoid(p.beta * p.h)


def _discopop(p: _Pairs) -> torch.Tensor:
    z = p.beta * p.h
    # (B,) blends logistic (small margins) and exponential (large) terms
    mix = torch.sigmoid(z / DISCOPOP_TAU)
    return -F.logsigmoid(z) * (1 - mix) + torch.exp(-z) * mix


def _aot(p: _Pairs) -> torch.Tensor:
    # Sorting pairs the policy's and the reference's margin quantiles (first-order dominance),
    # batch-wide. (B,)
    delta = (
        torch.sort(p.chosen - p.rejected).values - torch.sort(p.ref_chosen - p.ref_rejected).values
    )
    return _smoothed_sigmoid(p.beta * delta, p.eps)


def _aot_unpaired(p: _Pairs) -> torch.Tensor:
    delta = torch.sort(p.dc).values - torch.sort(p.dr).values  # (B,)
    return _smoothed_sigmoid(p.beta * delta, p.eps)


def _sft(p: _Pairs) -> torch.Tensor:
    # Token mean over the batch (TRL 1.16), broadcast per pair so that `.mean()` returns it
    # unchanged.
    nll = -p.chosen.sum() / p.chosen_len.sum()  # ()
    return nll.expand_as(p.chosen)  # (B,)


_PER_PAIR: dict[str, Callable[[_Pairs], torch.Tensor]] = {
    "sigmoid": _sigmoid, "hinge": _hinge, "ipo": _ipo,
    "sigmoid_norm": _sigmoid_norm, "robust": _robust,
    "exo_pair": _exo_pair, "nca_pair": _nca_pair, "bco_pair": _bco_pair, "sppo_hard": _sppo_hard,
    "apo_zero": _apo_zero, "apo_down": _apo_down, "discopop": _discopop, "aot": _aot,
    "aot_unpaired": _aot_unpaired, "sft": _sft,
}
assert set(_PER_PAIR) == set(LOSS_TYPES)


def _make_pairs(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps, chosen_lengths,
                rejected_lengths, loss_types, beta, label_smoothing) -> _Pairs:
    if chosen_logps.ndim != 1 or chosen_logps.shape != rejected_logps.shape:
        raise ValueError("chosen/rejected log-probs must both be (B,), got "
                         f"{tuple(chosen_logps.shape)} and {tuple(rejected_logps.shape)}")
    if (ref_chosen_logps is None) != (ref_rejected_logps is None):
        raise ValueError("pass both reference log-probs, or neither (reference-free)")
    if ref_chosen_logps is None:
        ref_chosen_logps = ref_rejected_logps = torch.zeros_like(chosen_logps)
    for t in (ref_chosen_logps, ref_rejected_logps):
        if t.shape != chosen_logps.shape:
            raise ValueError("reference log-probs must be "
                             f"{tuple(chosen_logps.shape)}, got {tuple(t.shape)}")
    lengths = {"chosen": chosen_lengths, "rejected": rejected_lengths}
    for loss_type in loss_types:
        for side in NEEDS_LENGTHS.get(loss_type, ()):
            if lengths[side] is None:
                raise ValueError(f"loss_type {loss_type!r} needs "
                                 f"{side}_lengths (completion token counts)")
    lengths = {k: None if v is None else _as_lengths(v, chosen_logps) for k, v in lengths.items()}
    return _Pairs(chosen_logps, rejected_logps, ref_chosen_logps.detach(),
                  ref_rejected_logps.detach(),
                  lengths["chosen"], lengths["rejected"], beta, label_smoothing)


def _as_lengths(lengths, like: torch.Tensor) -> torch.Tensor:
    # at least float32: bfloat16 cannot count past 256 exactly
    dtype = like.dtype if like.dtype == torch.float64 else torch.float32
    lengths = torch.as_tensor(lengths, device=like.device).to(dtype)
    if lengths.shape != like.shape:
        raise ValueError(f"lengths must be {tuple(like.shape)}, got {tuple(lengths.shape)}")
    return lengths.clamp(min=1.0)  # (B,) as TRL: an empty completion counts as one token


@torch.no_grad()
def wpo_weights(token_logps: torch.Tensor, log_sum_sq_probs: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    """WPO's weight of each response (Zhou et al. 2024, arXiv:2406.11827, Eq. 2, as TRL 1.16's
    `use_weighting`), no gradient:

        w(y) = exp( (1/|y|) Σ_t m_t (log π(y_t) - log Σ_v π(v)²) )

    the response's per-token probability relative to the policy's own expected probability of a
    token it would sample (Σ_v π(v)², `head.token_stats`), so off-policy pairs weigh less.
    token_logps, log_sum_sq_probs, mask: (B, T) -> (B,)."""
    lengths = mask.sum(-1).clamp(min=1)  # (B,)
    return torch.exp(((token_logps - log_sum_sq_probs) * mask).sum(-1) / lengths)  # (B,)


TOKEN_SUMS = ("entropy", "tokens", "logits/chosen", "chosen_tokens",
              "logits/rejected", "rejected_tokens", "mean_token_accuracy")


@torch.no_grad()
def token_sums(stats: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The sums behind TRL's per-token DPO metrics, over a batch whose first half of rows are the
    chosen responses and second half the rejected: (2B, T, 4) `head.token_stats`, (2B, T) mask ->
    (7,) in TOKEN_SUMS order (sums add over micro-batches and ranks; `token_metrics` divides)."""
    m = mask.to(stats.dtype)  # (2B, T)
    chosen, rejected = m.chunk(2)  # (B, T) each
    s_chosen, s_rejected = stats.chunk(2)  # (B, T, 4) each
    return torch.stack([
        (stats[..., 0] * m).sum(), m.sum(), (s_chosen[..., 1] * chosen).sum(), chosen.sum(),
        (s_rejected[..., 1] * rejected).sum(), rejected.sum(), (s_chosen[..., 2] * chosen).sum()])


def token_metrics(sums) -> dict[str, float]:
    """TRL's `entropy` (all completion tokens), `logits/chosen`, `logits/rejected` (the mean logit
    over the vocabulary, averaged over the side's tokens) and `mean_token_accuracy` (chosen tokens
    that are the argmax) from `token_sums` (floats); 0 for a side without tokens, as TRL."""
    s = dict(zip(TOKEN_SUMS, sums))
    ratio = lambda a, b: s[a] / s[b] if s[b] > 0 else 0.0  # noqa: E731
    return {"entropy": ratio("entropy", "tokens"),
            "logits/chosen": ratio("logits/chosen", "chosen_tokens"),
            "logits/rejected": ratio("logits/rejected", "rejected_tokens"),
            "mean_token_accuracy": ratio("mean_token_accuracy", "chosen_tokens")}


@torch.no_grad()
def implicit_rewards(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
                     ref_chosen_logps: torch.Tensor | None,
                     ref_rejected_logps: torch.Tensor | None,
                     beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DPO's implicit rewards r = β·(log π(y|x) - log π_ref(y|x)) of the chosen and the rejected
    responses, (B,) each (arXiv:2305.18290, eq. 5); no reference (reference-free) counts as 0. A
    pair is ranked right when r_c > r_r (TRL's `rewards/accuracies`, strict)."""
    ref_c = 0.0 if ref_chosen_logps is None else ref_chosen_logps
    ref_r = 0.0 if ref_rejected_logps is None else ref_rejected_logps
    return beta * (chosen_logps - ref_c), beta * (rejected_logps - ref_r)


@torch.no_grad()
def _metrics(p: _Pairs, sync: bool = True) -> dict[str, float] | dict[str, torch.Tensor]:
    """TRL's DPO metrics: batch means of rewards β·Δ, of reward accuracy (strict >), margins and
    log-probs."""
    chosen_rewards, rejected_rewards = implicit_rewards(p.chosen, p.rejected,
                                                        p.ref_chosen, p.ref_rejected,
                                                        p.beta)  # (B,), (B,)
    stats = torch.stack([
        chosen_rewards.mean(), rejected_rewards.mean(),
        (chosen_rewards > rejected_rewards).to(p.dc.dtype).mean(),
        (chosen_rewards - rejected_rewards).mean(), p.chosen.mean(), p.rejected.mean(),
    ])
    stats = stats.tolist() if sync else stats.unbind()  # one device sync for all six, or none
    names = ("rewards/chosen", "rewards/rejected", "rewards/accuracies",
             "rewards/margins", "logps/chosen", "logps/rejected")
    return dict(zip(names, stats))


def dpo_loss_multi(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor | None,
    ref_rejected_logps: torch.Tensor | None,
    *,
    loss_types: list[str],
    loss_weights: list[float] | None,
    beta: float = 0.1,
    label_smoothing: float = 0.0,
    chosen_lengths: torch.Tensor | None = None,
    rejected_lengths: torch.Tensor | None = None,
    pair_weights: torch.Tensor | None = None,
    sync_metrics: bool = True,
) -> tuple[torch.Tensor, dict[str, float] | dict[str, torch.Tensor]]:
    """Weighted sum of DPO losses, as TRL 1.16's `loss_type=[...]` + `loss_weights`:

        L = Σ_k w_k · mean_i ℓ_k,i     (w_k = 1 when loss_weights is None)

    e.g. RPO (arXiv:2404.19733) is loss_types=["sigmoid", "sft"], loss_weights=[1.0, α]. The
    per-type formulas are in this module's docstring. Returns (scalar loss, metrics) like
    `dpo_loss`; with sync_metrics=False the metrics are 0-dim tensors (no host sync: a loop reads
    them once per step). pair_weights: (B,) multiply each pair's ℓ_i (WPO: w(y_c) w(y_r),
    `wpo_weights`); None = 1.
    """
    check_dpo_options(loss_types, loss_weights, beta, label_smoothing)
    if pair_weights is not None and {"aot", "aot_unpaired"} & set(loss_types):
        raise DPOOptionError("WPO weighting is per pair; aot and "
                             "aot_unpaired sort terms across pairs",
                             where="dpo.use_weighting")
    pairs = _make_pairs(chosen_logps, rejected_logps, ref_chosen_logps,
                        ref_rejected_logps, chosen_lengths,
                        rejected_lengths, loss_types, beta, label_smoothing)
    weights = loss_weights if loss_weights is not None else [1.0] * len(loss_types)
    scale = 1.0 if pair_weights is None else pair_weights.detach()  # (B,)
    loss = sum(w * (_PER_PAIR[t](pairs) * scale).mean() for t,
               w in zip(loss_types, weights, strict=True))
    return loss, _metrics(pairs, sync_metrics)


def dpo_loss(chosen_logps: torch.Tensor, rejected_logps: torch.Tensor,
             ref_chosen_logps: torch.Tensor | None,
             ref_rejected_logps: torch.Tensor | None, *,
             loss_type: str = "sigmoid", beta: float = 0.1,
             label_smoothing: float = 0.0, chosen_lengths: torch.Tensor | None = None,
             rejected_lengths: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """One DPO-family loss (formulas and papers in the module docstring), averaged over the B pairs.

    chosen_logps, rejected_logps: (B,) policy log-probs summed over completion tokens (carry
    gradients). ref_chosen_logps, ref_rejected_logps: (B,) reference log-probs, or both None for
    reference-free. chosen_lengths, rejected_lengths: (B,) completion token counts; required by ipo,
    sigmoid_norm (both) and sft (chosen). Returns (scalar loss, metrics) with TRL's metric names:
    rewards/chosen, rewards/rejected, rewards/accuracies, rewards/margins, logps/chosen,
    logps/rejected (batch means, reward = β·(log π - log π_ref)).
    """
    return dpo_loss_multi(chosen_logps, rejected_logps, ref_chosen_logps, ref_rejected_logps,
                          loss_types=[loss_type], loss_weights=None, beta=beta,
                          label_smoothing=label_smoothing,
                          chosen_lengths=chosen_lengths, rejected_lengths=rejected_lengths)
