"""DPO losses: hand-worked values, agreement with TRL 1.16's real trainer code, metrics, accumulation."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from preftune.errors import UserError
from preftune.losses import dpo_loss as lazy_dpo_loss
from preftune.losses.dpo import (BATCH_LEVEL, LOSS_TYPES, dpo_loss, dpo_loss_multi, token_metrics, token_sums,
                                 wpo_weights)

F64 = torch.float64
PER_PAIR = [t for t in LOSS_TYPES if t not in BATCH_LEVEL]
# label_smoothing values to exercise per type (0 wherever the type ignores it)
SMOOTHING = {"robust": [0.0, 0.1], "exo_pair": [1e-3, 0.2], "aot": [0.0, 0.1], "aot_unpaired": [0.0, 0.1]}


def _lsig(x: float) -> float:
    return -math.log1p(math.exp(-x))


def _batch(b: int, seed: int):
    """Random float64 pairs: summed log-probs that scale with length, log-ratios of both signs."""
    g = torch.Generator().manual_seed(seed)
    lens_c = torch.randint(1, 9, (b,), generator=g)
    lens_r = torch.randint(1, 9, (b,), generator=g)
    ref_c = -lens_c * (0.5 + 2 * torch.rand(b, generator=g, dtype=F64))  # (B,)
    ref_r = -lens_r * (0.5 + 2 * torch.rand(b, generator=g, dtype=F64))  # (B,)
    chosen = ref_c + 4 * torch.rand(b, generator=g, dtype=F64) - 2  # (B,)
    rejected = ref_r + 4 * torch.rand(b, generator=g, dtype=F64) - 2  # (B,)
    return chosen, rejected, ref_c, ref_r, lens_c, lens_r


def _grad(x: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(x) if x.grad is None else x.grad  # sft never touches the rejected side


def _ours(chosen, rejected, ref_c, ref_r, lens_c, lens_r, loss_types, weights, beta, eps):
    c, r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    loss, metrics = dpo_loss_multi(c, r, ref_c, ref_r, loss_types=loss_types, loss_weights=weights, beta=beta,
                                   label_smoothing=eps, chosen_lengths=lens_c, rejected_lengths=lens_r)
    loss.backward()
    return loss.detach(), _grad(c), _grad(r), metrics


def _trl(chosen, rejected, ref_c, ref_r, lens_c, lens_r, loss_types, weights, beta, eps):
    """Run TRL 1.16's `DPOTrainer._compute_loss` on a stand-in trainer and model.

    TRL 1.16 has no standalone dpo_loss: the loss lives in `_compute_loss`, which reads per-token
    log-probs from the model output. The fake model returns, for sequence i, log π_i/|y_i| on each of
    its |y_i| completion tokens (0 elsewhere), so TRL's token sums are exactly our summed log-probs and
    the gradient reaches the (B,) leaves through the same chain rule.
    """
    from trl.trainer.dpo_trainer import DPOTrainer

    c, r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    lens = torch.cat([lens_c, lens_r])  # (2B,) batch is [chosen, rejected]
    t = 1 + int(lens.max())
    pos = torch.arange(t)
    completion_mask = ((pos >= 1) & (pos <= lens[:, None])).long()  # (2B, T) position 0 is the prompt
    per_token = completion_mask[:, 1:] * (torch.cat([c, r]) / lens)[:, None]  # (2B, T-1)
    zeros = torch.zeros_like(per_token)
    outputs = SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True), aux_loss_enabled=False, precompute_ref_logps=True,
        accelerator=SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x),
        ld_alpha=None, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5, use_weighting=False,
        loss_types=loss_types, loss_weights=weights or [1.0] * len(loss_types), beta=beta, label_smoothing=eps,
        args=SimpleNamespace(discopop_tau=0.05), _metrics={"train": defaultdict(list)}, _total_train_tokens=0,
        _tp_size=1)
    inputs = {"input_ids": torch.zeros_like(completion_mask), "attention_mask": torch.ones_like(completion_mask),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    # exo_pair builds ε with torch.tensor(...), float32 by default: that alone costs ~1e-7, so the
    # comparison runs with a float64 default dtype.
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(F64)
    try:
        loss = DPOTrainer._compute_loss(stub, lambda **kw: outputs, inputs, return_outputs=False)
    finally:
        torch.set_default_dtype(default_dtype)
    loss.backward()
    metrics = {k: v[-1] for k, v in stub._metrics["train"].items()}
    return loss.detach(), _grad(c), _grad(r), metrics


# ------------------------------------------------------------------ hand-worked values

# beta = 0.5. Pair 1: Δc = -2-(-3) = 1, Δr = -4-(-3) = -1, h = 2, βh = 1. Pair 2: Δc = Δr = 0, βh = 0.
HAND = dict(chosen=[-2.0, -5.0], rejected=[-4.0, -6.0], ref_c=[-3.0, -5.0], ref_r=[-3.0, -6.0])


def _hand(loss_type, eps=0.0, lens_c=None, lens_r=None):
    t = {k: torch.tensor(v, dtype=F64) for k, v in HAND.items()}
    return dpo_loss(t["chosen"], t["rejected"], t["ref_c"], t["ref_r"], loss_type=loss_type, beta=0.5,
                    label_smoothing=eps, chosen_lengths=lens_c, rejected_lengths=lens_r)


def test_sigmoid_hand_worked():
    loss, _ = _hand("sigmoid")
    # pair 1: -log σ(1) = log(1 + e^-1) = 0.31326; pair 2: -log σ(0) = log 2 = 0.69315; mean 0.50320
    assert loss.item() == pytest.approx((math.log1p(math.exp(-1)) + math.log(2)) / 2, abs=1e-12)
    assert loss.item() == pytest.approx(0.5032044, abs=1e-7)


def test_hinge_hand_worked():
    loss, _ = _hand("hinge")
    # pair 1: max(0, 1 - 1) = 0; pair 2: max(0, 1 - 0) = 1; mean 0.5
    assert loss.item() == pytest.approx(0.5, abs=1e-12)


def test_ipo_hand_worked_is_length_normalised():
    loss, _ = _hand("ipo", lens_c=torch.tensor([2, 3]), lens_r=torch.tensor([1, 4]))
    # 1/(2β) = 1. pair 1: (1/2 - (-1)/1 - 1)² = 0.5² = 0.25; pair 2: (0 - 0 - 1)² = 1; mean 0.625
    assert loss.item() == pytest.approx(0.625, abs=1e-12)
    # unnormalised it would be pair 1: (2 - 1)² = 1, mean 1.0: the lengths must matter
    loss_len1, _ = _hand("ipo", lens_c=torch.tensor([1, 1]), lens_r=torch.tensor([1, 1]))
    assert loss_len1.item() == pytest.approx(1.0, abs=1e-12)


def test_robust_hand_worked():
    loss, _ = _hand("robust", eps=0.25)
    # pair 1: (-0.75 log σ(1) + 0.25 log σ(-1)) / 0.5 = (0.23495 - 0.32832) / 0.5 = -0.18674
    # pair 2: (0.75 log 2 - 0.25 log 2) / 0.5 = log 2 = 0.69315; mean 0.25320
    pair1 = (-0.75 * _lsig(1.0) + 0.25 * _lsig(-1.0)) / 0.5
    assert pair1 == pytest.approx(-0.1867383, abs=1e-7)
    assert loss.item() == pytest.approx((pair1 + math.log(2)) / 2, abs=1e-12)
    # ε = 0 is plain DPO
    assert _hand("robust", eps=0.0)[0].item() == pytest.approx(_hand("sigmoid")[0].item(), abs=1e-12)


def test_metrics_hand_worked():
    _, m = _hand("sigmoid")
    # rewards β·Δ: chosen (0.5, 0), rejected (-0.5, 0); accuracy strict >: (1, 0)
    assert m == pytest.approx({"rewards/chosen": 0.25, "rewards/rejected": -0.25, "rewards/accuracies": 0.5,
                               "rewards/margins": 0.5, "logps/chosen": -3.5, "logps/rejected": -5.0}, abs=1e-12)
    assert all(type(v) is float for v in m.values())


# ------------------------------------------------------------------ against TRL 1.16

CASES = [(t, eps, ref) for t in LOSS_TYPES for eps in SMOOTHING.get(t, [0.0]) for ref in (True, False)]


@pytest.mark.parametrize("loss_type,eps,with_ref", CASES)
def test_matches_trl(loss_type, eps, with_ref):
    chosen, rejected, ref_c, ref_r, lens_c, lens_r = _batch(7, seed=len(loss_type) + int(100 * eps))
    beta = 0.3
    if not with_ref:  # TRL 1.16 has no reference_free flag: zeros are its equivalent
        ref_c, ref_r = torch.zeros_like(ref_c), torch.zeros_like(ref_r)
    trl = _trl(chosen, rejected, ref_c, ref_r, lens_c, lens_r, [loss_type], None, beta, eps)
    ours = _ours(chosen, rejected, ref_c if with_ref else None, ref_r if with_ref else None, lens_c, lens_r,
                 [loss_type], None, beta, eps)
    for a, b in zip(ours[:3], trl[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-8)
    assert ours[1].abs().sum() + ours[2].abs().sum() > 0  # gradients reach the inputs


@pytest.mark.parametrize("loss_types,weights,eps", [
    (["sigmoid", "sft"], [1.0, 0.5], 0.0),  # RPO
    (["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], 0.0),  # MPO's example weights
    (["robust", "ipo", "aot"], None, 0.1),
])
def test_multi_matches_trl(loss_types, weights, eps):
    chosen, rejected, ref_c, ref_r, lens_c, lens_r = _batch(5, seed=3)
    trl = _trl(chosen, rejected, ref_c, ref_r, lens_c, lens_r, loss_types, weights, 0.2, eps)
    ours = _ours(chosen, rejected, ref_c, ref_r, lens_c, lens_r, loss_types, weights, 0.2, eps)
    for a, b in zip(ours[:3], trl[:3]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-8)


def test_multi_is_weighted_sum_of_singles():
    chosen, rejected, ref_c, ref_r, lens_c, lens_r = _batch(4, seed=9)
    kw = dict(beta=0.2, chosen_lengths=lens_c, rejected_lengths=lens_r)
    multi, _ = dpo_loss_multi(chosen, rejected, ref_c, ref_r, loss_types=["sigmoid", "ipo"], loss_weights=[0.3, 2.0],
                              **kw)
    singles = [dpo_loss(chosen, rejected, ref_c, ref_r, loss_type=t, **kw)[0] for t in ("sigmoid", "ipo")]
    assert multi.item() == pytest.approx(0.3 * singles[0].item() + 2.0 * singles[1].item(), abs=1e-12)


@pytest.mark.parametrize("with_ref", [True, False])
def test_metrics_match_trl(with_ref):
    chosen, rejected, ref_c, ref_r, lens_c, lens_r = _batch(6, seed=5)
    if not with_ref:
        ref_c, ref_r = torch.zeros_like(ref_c), torch.zeros_like(ref_r)
    trl_metrics = _trl(chosen, rejected, ref_c, ref_r, lens_c, lens_r, ["sigmoid"], None, 0.4, 0.0)[3]
    ours = _ours(chosen, rejected, ref_c if with_ref else None, ref_r if with_ref else None, lens_c, lens_r,
                 ["sigmoid"], None, 0.4, 0.0)[3]
    assert set(ours) <= set(trl_metrics)
    assert ours == pytest.approx({k: trl_metrics[k] for k in ours}, abs=1e-10)
    if with_ref:
        assert 0.0 < ours["rewards/accuracies"] < 1.0  # the batch exercises both outcomes


def test_lazy_export():
    assert lazy_dpo_loss is dpo_loss


# ------------------------------------------------------------------ gradient accumulation

SPLIT = [2, 1, 4]  # uneven micro-batches of a 7-pair batch


def _accumulated(loss_types, eps, split, chosen, rejected, ref_c, ref_r, lens_c, lens_r):
    """Σ_k (b_k/B) · L(micro-batch k), backpropagated once per micro-batch like the training loop."""
    c, r = chosen.clone().requires_grad_(), rejected.clone().requires_grad_()
    total, start, n = 0.0, 0, len(chosen)
    for b in split:
        s = slice(start, start + b)
        loss, _ = dpo_loss_multi(c[s], r[s], ref_c[s], ref_r[s], loss_types=loss_types, loss_weights=None, beta=0.3,
                                 label_smoothing=eps, chosen_lengths=lens_c[s], rejected_lengths=lens_r[s])
        (loss * b / n).backward()
        total += loss.item() * b / n
        start += b
    return total, c.grad, r.grad


@pytest.mark.parametrize("loss_type", PER_PAIR)
def test_per_pair_types_are_accumulation_invariant(loss_type):
    data = _batch(7, seed=11)
    eps = SMOOTHING.get(loss_type, [0.0])[-1]
    full = _accumulated([loss_type], eps, [7], *data)
    split = _accumulated([loss_type], eps, SPLIT, *data)
    assert split[0] == pytest.approx(full[0], abs=1e-10)
    for a, b in zip(split[1:], full[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("loss_type", ["aot", "aot_unpaired"])
def test_aot_is_batch_level(loss_type):
    """Documented: the sort spans the (micro-)batch, so the loss is permutation invariant, equals the
    per-pair smoothed DPO for a single pair, and changes when the batch is split."""
    data = _batch(7, seed=13)
    full = _accumulated([loss_type], 0.1, [7], *data)
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(0))
    permuted = _accumulated([loss_type], 0.1, [7], *(x[perm] for x in data))
    assert permuted[0] == pytest.approx(full[0], abs=1e-10)
    split = _accumulated([loss_type], 0.1, SPLIT, *data)
    assert abs(split[0] - full[0]) > 1e-4
    # one pair per micro-batch: each sort is the identity and both variants are cDPO on h = Δc - Δr
    singles = _accumulated([loss_type], 0.1, [1] * 7, *data)
    c, r, rc, rr = data[:4]
    z = 0.3 * ((c - r) - (rc - rr))  # (B,)
    expected = (-0.9 * torch.nn.functional.logsigmoid(z) - 0.1 * torch.nn.functional.logsigmoid(-z)).mean()
    assert singles[0] == pytest.approx(expected.item(), abs=1e-10)


def test_sft_is_a_batch_token_mean():
    """Documented: sft is the mean NLL over all chosen tokens of the (micro-)batch, so b/B weighting of
    micro-batches reproduces the full batch only when every chosen completion has the same length."""
    chosen, rejected, ref_c, ref_r, lens_c, lens_r = _batch(7, seed=17)
    loss, _ = dpo_loss(chosen, rejected, ref_c, ref_r, loss_type="sft", chosen_lengths=lens_c)
    assert loss.item() == pytest.approx((-chosen.sum() / lens_c.sum()).item(), abs=1e-12)
    data = (chosen, rejected, ref_c, ref_r, lens_c, lens_r)
    assert abs(_accumulated(["sft"], 0.0, SPLIT, *data)[0] - _accumulated(["sft"], 0.0, [7], *data)[0]) > 1e-4
    equal = (chosen, rejected, ref_c, ref_r, torch.full_like(lens_c, 5), lens_r)
    full, split = _accumulated(["sft"], 0.0, [7], *equal), _accumulated(["sft"], 0.0, SPLIT, *equal)
    assert split[0] == pytest.approx(full[0], abs=1e-10)
    torch.testing.assert_close(split[1], full[1], rtol=0, atol=1e-10)


# ------------------------------------------------------------------ inputs and options


def test_reference_free_equals_zero_reference():
    chosen, rejected, _, _, lens_c, lens_r = _batch(4, seed=19)
    zeros = torch.zeros_like(chosen)
    for loss_type in LOSS_TYPES:
        eps = SMOOTHING.get(loss_type, [0.0])[-1]
        kw = dict(loss_type=loss_type, label_smoothing=eps, chosen_lengths=lens_c, rejected_lengths=lens_r)
        free, m_free = dpo_loss(chosen, rejected, None, None, **kw)
        zero, m_zero = dpo_loss(chosen, rejected, zeros, zeros, **kw)
        assert free.item() == pytest.approx(zero.item(), abs=1e-12) and m_free == m_zero


def test_zero_length_counts_as_one_token():
    chosen, rejected, ref_c, ref_r, _, _ = _batch(3, seed=23)
    kw = dict(loss_type="ipo", rejected_lengths=torch.tensor([1, 2, 3]))
    a, _ = dpo_loss(chosen, rejected, ref_c, ref_r, chosen_lengths=torch.tensor([0, 4, 0]), **kw)
    b, _ = dpo_loss(chosen, rejected, ref_c, ref_r, chosen_lengths=torch.tensor([1, 4, 1]), **kw)
    assert a.item() == pytest.approx(b.item(), abs=1e-12)


def test_unknown_loss_type_lists_valid_ones():
    x = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match="sigmoid.*sppo_hard") as info:
        dpo_loss(x, x, x, x, loss_type="dpo")
    assert isinstance(info.value, UserError) and info.value.where == "dpo.loss_type"


@pytest.mark.parametrize("loss_type,kwargs", [("ipo", {}), ("sigmoid_norm", {"chosen_lengths": torch.ones(2)}),
                                              ("sft", {"rejected_lengths": torch.ones(2)})])
def test_length_normalised_types_need_lengths(loss_type, kwargs):
    x = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match="lengths"):
        dpo_loss(x, x, x, x, loss_type=loss_type, **kwargs)


@pytest.mark.parametrize("kwargs,key", [
    (dict(loss_type="exo_pair"), "dpo.label_smoothing"),  # EXO needs ε > 0 (log ε)
    (dict(loss_type="robust", label_smoothing=0.5), "dpo.label_smoothing"),  # divides by 1 - 2ε
    (dict(loss_type="sigmoid", label_smoothing=0.1), "dpo.label_smoothing"),  # silently unused in TRL 1.16
    (dict(loss_type="ipo", beta=0.0), "dpo.beta"),  # IPO/SPPO divide by β
])
def test_bad_options_raise_user_errors(kwargs, key):
    x = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError) as info:
        dpo_loss(x, x, x, x, chosen_lengths=torch.ones(2), rejected_lengths=torch.ones(2), **kwargs)
    assert isinstance(info.value, UserError) and info.value.where == key


def test_bad_inputs_raise():
    x = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match="weights"):
        dpo_loss_multi(x, x, x, x, loss_types=["sigmoid", "hinge"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="both reference"):
        dpo_loss(x, x, x, None)
    with pytest.raises(ValueError, match=r"\(B,\)"):
        dpo_loss(x, torch.zeros(3, dtype=F64), x, x)


# ------------------------------------------------------------------ WPO weighting and per-token metrics vs TRL 1.16


def _token_batch(b: int, seed: int):
    """(2B, T) per-token log-probs, log Σπ², mean logits, top-1 flags, entropies and the mask: the
    first B rows chosen, the last B rejected (TRL's batch order)."""
    g = torch.Generator().manual_seed(seed)
    t = 6
    lens = torch.randint(1, t + 1, (2 * b,), generator=g)
    mask = (torch.arange(t)[None, :] < lens[:, None]).to(F64)  # (2B, T)
    logps = -2 * torch.rand(2 * b, t, generator=g, dtype=F64) * mask  # (2B, T)
    lss = -1.5 * torch.rand(2 * b, t, generator=g, dtype=F64)  # log Σ π² <= 0
    stats = torch.stack([torch.rand(2 * b, t, generator=g, dtype=F64),  # entropy
                         torch.randn(2 * b, t, generator=g, dtype=F64),  # mean logit
                         (torch.rand(2 * b, t, generator=g) < 0.5).to(F64),  # top-1
                         lss], -1)  # (2B, T, 4)
    return logps, stats, mask


def _trl_tokens(logps, stats, mask, ref_c, ref_r, loss_types, beta, use_weighting):
    """TRL 1.16's `_compute_loss` on a stand-in model that returns these per-token values."""
    from trl.trainer.dpo_trainer import DPOTrainer

    leaf = logps.clone().requires_grad_()
    completion_mask = torch.cat([torch.zeros_like(mask[:, :1]), mask], 1).long()  # (2B, T+1): position 0 is the prompt
    outputs = SimpleNamespace(log_probs=leaf, entropy=stats[..., 0], mean_logits=stats[..., 1],
                              is_top1=stats[..., 2].bool(), log_sum_sq_probs=stats[..., 3])
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True), aux_loss_enabled=False, precompute_ref_logps=True,
        accelerator=SimpleNamespace(device="cpu", gather=lambda x: x, gather_for_metrics=lambda x: x),
        ld_alpha=None, f_divergence_type="reverse_kl", f_alpha_divergence_coef=0.5, use_weighting=use_weighting,
        loss_types=loss_types, loss_weights=[1.0] * len(loss_types), beta=beta, label_smoothing=0.0,
        args=SimpleNamespace(discopop_tau=0.05), _metrics={"train": defaultdict(list)}, _total_train_tokens=0,
        _tp_size=1)
    inputs = {"input_ids": torch.zeros_like(completion_mask), "attention_mask": torch.ones_like(completion_mask),
              "completion_mask": completion_mask, "ref_chosen_logps": ref_c, "ref_rejected_logps": ref_r}
    loss = DPOTrainer._compute_loss(stub, lambda **kw: outputs, inputs, return_outputs=False)
    loss.backward()
    return loss.detach(), leaf.grad, {k: v[-1] for k, v in stub._metrics["train"].items()}


# (TRL 1.16 itself fails on sft and hinge with use_weighting: it scales their losses in place)
@pytest.mark.parametrize("loss_types", [["sigmoid"], ["ipo"], ["sigmoid", "nca_pair"], ["apo_zero"], ["discopop"]])
def test_wpo_weighting_matches_trl(loss_types):
    b = 4
    logps, stats, mask = _token_batch(b, seed=len(loss_types) + len(loss_types[0]))
    g = torch.Generator().manual_seed(1)
    ref_c, ref_r = -3 * torch.rand(b, generator=g, dtype=F64), -3 * torch.rand(b, generator=g, dtype=F64)
    leaf = logps.clone().requires_grad_()
    sums, lengths = (leaf * mask).sum(-1), mask.sum(-1)  # (2B,)
    w = wpo_weights(leaf, stats[..., 3], mask)  # (2B,)
    assert not w.requires_grad and (w - 1).abs().max() > 0.05  # weights that matter
    loss, _ = dpo_loss_multi(sums[:b], sums[b:], ref_c, ref_r, loss_types=loss_types, loss_weights=None, beta=0.3,
                             chosen_lengths=lengths[:b], rejected_lengths=lengths[b:], pair_weights=w[:b] * w[b:])
    loss.backward()
    trl_loss, trl_grad, _ = _trl_tokens(logps, stats, mask, ref_c, ref_r, loss_types, 0.3, use_weighting=True)
    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-12)
    # TRL sums log-probs unmasked (its head gives 0 at padding): compare the completion tokens
    torch.testing.assert_close(leaf.grad * mask, trl_grad * mask, rtol=0, atol=1e-12)


def test_wpo_hand_worked():
    # one response of 2 tokens: log π = (-1, -2), log Σπ² = (-0.5, -1): w = exp(((-0.5) + (-1)) / 2) = e^-0.75
    w = wpo_weights(torch.tensor([[-1.0, -2.0, -9.0]], dtype=F64), torch.tensor([[-0.5, -1.0, 0.0]], dtype=F64),
                    torch.tensor([[1.0, 1.0, 0.0]], dtype=F64))
    assert w.item() == pytest.approx(math.exp(-0.75), abs=1e-15)
    # a pair's sigmoid loss scaled by w_c w_r = 0.5: 0.5 * -log σ(1) (pair 1 of HAND, β = 0.5)
    t = {k: torch.tensor(v[:1], dtype=F64) for k, v in HAND.items()}
    loss, _ = dpo_loss_multi(t["chosen"], t["rejected"], t["ref_c"], t["ref_r"], loss_types=["sigmoid"],
                             loss_weights=None, beta=0.5, pair_weights=torch.tensor([0.5], dtype=F64))
    assert loss.item() == pytest.approx(-0.5 * _lsig(1.0), abs=1e-15)


def test_wpo_refuses_the_sorted_losses():
    c = torch.zeros(2, dtype=F64)
    with pytest.raises(UserError, match="dpo.use_weighting"):
        dpo_loss_multi(c, c, c, c, loss_types=["aot"], loss_weights=None, pair_weights=torch.ones(2, dtype=F64))


def test_token_metrics_match_trl():
    b = 3
    logps, stats, mask = _token_batch(b, seed=11)
    ref = torch.zeros(b, dtype=F64)
    ours = token_metrics(token_sums(stats, mask).tolist())
    _, _, trl_metrics = _trl_tokens(logps, stats, mask, ref, ref, ["sigmoid"], 0.1, use_weighting=False)
    exact = {k: v for k, v in ours.items() if k != "mean_token_accuracy"}
    assert exact == pytest.approx({k: trl_metrics[k] for k in exact}, abs=1e-12)
    # TRL divides two integer counts into float32
    assert ours["mean_token_accuracy"] == pytest.approx(trl_metrics["mean_token_accuracy"], abs=1e-7)
    assert ours["mean_token_accuracy"] not in (0.0, 1.0)
