"""kto_loss: hand-worked values, TRL 1.16 KTOTrainer parity in float64 (loss, gradients, metrics),
micro-batch and data-parallel invariance through kto_reference_point + normaliser, and TRL's weight advice."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from preftune.losses import kto_loss
from preftune.losses.kto import kto_metrics, kto_reference_point, weight_advice

F64 = torch.float64
NAMES = {"kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "rewards/margins"}


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


# ------------------------------------------------------------------ hand-worked values


def test_kto_hand_worked():
    # beta = 0.5. r = [1, -2, 0.5]; labels [D, U, D]. Mismatched log-ratios [0.4, 0.8] -> z = 0.6.
    # D: 1 - σ(0.5 (1 - 0.6)) = 1 - σ(0.2);  U: 1 - σ(0.5 (0.6 + 2)) = 1 - σ(1.3);  D: 1 - σ(0.5 (-0.1)).
    # Weights λ_D = 2, λ_U = 1: L = (2 (1 - σ(0.2)) + (1 - σ(1.3)) + 2 (1 - σ(-0.05))) / 3.
    logps = torch.tensor([-3.0, -6.0, -1.5], dtype=F64)
    ref = torch.tensor([-4.0, -4.0, -2.0], dtype=F64)
    labels = torch.tensor([True, False, True])
    kl, ref_kl = torch.tensor([-1.6, -2.2], dtype=F64), torch.tensor([-2.0, -3.0], dtype=F64)
    loss, m = kto_loss(logps, ref, labels, kl, ref_kl, beta=0.5, desirable_weight=2.0, undesirable_weight=1.0)
    want = (2 * (1 - _sig(0.2)) + (1 - _sig(1.3)) + 2 * (1 - _sig(-0.05))) / 3
    assert loss.item() == pytest.approx(want, abs=1e-12)
    assert m["kl"] == pytest.approx(0.6, abs=1e-12)
    assert m["rewards/chosen"] == pytest.approx(0.5 * (1 + 0.5) / 2) and m["rewards/rejected"] == pytest.approx(-1.0)
    assert m["logps/chosen"] == pytest.approx(-2.25) and m["logps/rejected"] == pytest.approx(-6.0)
    assert m["rewards/margins"] == pytest.approx(0.375 + 1.0)


def test_reference_point_is_clamped_at_zero_and_detached():
    logps = torch.tensor([-1.0, -2.0], dtype=F64, requires_grad=True)
    kl = torch.tensor([-5.0, -5.0], dtype=F64, requires_grad=True)  # log-ratio -3 each: z = max(0, -3) = 0
    loss, m = kto_loss(logps, torch.tensor([-1.0, -2.0], dtype=F64), torch.tensor([True, False]), kl,
                       torch.tensor([-2.0, -2.0], dtype=F64), beta=1.0)
    assert m["kl"] == 0.0
    assert loss.item() == pytest.approx((1 - _sig(0.0) + 1 - _sig(0.0)) / 2)  # r = 0, z = 0
    loss.backward()
    assert kl.grad is None or torch.all(kl.grad == 0)  # z carries no gradient
    # d/dr (1 - σ(βr)) = -β σ(1 - σ) = -0.25 for the desirable row, +0.25 for the undesirable; / B = 2
    torch.testing.assert_close(logps.grad, torch.tensor([-0.125, 0.125], dtype=F64))


def test_apo_zero_unpaired_hand_worked():
    # r = [1, -2]: D 1 - σ(0.5), U σ(-1); no z, kl logged as 0
    loss, m = kto_loss(torch.tensor([0.0, -3.0], dtype=F64), torch.tensor([-1.0, -1.0], dtype=F64),
                       torch.tensor([True, False]), None, None, beta=0.5, loss_type="apo_zero_unpaired")
    assert loss.item() == pytest.approx((1 - _sig(0.5) + _sig(-1.0)) / 2, abs=1e-12)
    assert m["kl"] == 0.0


def test_one_label_only_has_only_its_metrics():
    _, m = kto_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-1.5, -2.5]), torch.tensor([True, True]),
                    torch.tensor([-1.0, -1.0]), torch.tensor([-1.0, -1.0]))
    assert set(m) == {"kl", "rewards/chosen", "logps/chosen"}


@pytest.mark.parametrize("kwargs, match", [
    ({"loss_type": "bco"}, "kto, apo_zero_unpaired"), ({"beta": 0.0}, "beta"),
    ({"labels": torch.tensor([1, 0])}, "bool"), ({"kl_logps": None}, "kl_logps"),
])
def test_bad_inputs_raise(kwargs, match):
    args = dict(logps=torch.zeros(2), ref_logps=torch.zeros(2), labels=torch.tensor([True, False]),
                kl_logps=torch.zeros(2), ref_kl_logps=torch.zeros(2))
    kw = {k: kwargs.pop(k) for k in list(kwargs) if k in args}
    with pytest.raises(ValueError, match=match):
        kto_loss(**(args | kw), **kwargs)


# ------------------------------------------------------------------ TRL 1.16 parity


def _batch(seed: int, B: int = 7):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(B, generator=g, dtype=F64) * 20
    ref = logps + torch.randn(B, generator=g, dtype=F64)
    labels = torch.tensor([True, False, True, True, False, False, True][:B])
    kl = -torch.rand(B, generator=g, dtype=F64) * 20
    ref_kl = kl - torch.rand(B, generator=g, dtype=F64)  # a positive mean log-ratio: z > 0
    lens = torch.randint(1, 6, (B,), generator=g).to(F64)
    return logps, ref, labels, kl, ref_kl, lens


def _trl(logps, ref, labels, kl, ref_kl, lens, *, beta, dw, uw, loss_type):
    """Run TRL 1.16's `KTOTrainer._compute_loss` on a stand-in trainer and model. TRL 1.16 has no
    standalone KTO loss: it reads per-token log-probs from the model output. The fake model returns,
    for row i, log π_i/|y_i| on each of its |y_i| completion tokens, so TRL's token sums are the
    summed log-probs and the gradient reaches the (B,) leaf through the same chain rule; the
    mismatched pairs' summed log-probs come from `_compute_kl_logps`, stubbed to return them."""
    from trl.trainer.kto_trainer import KTOTrainer

    x = logps.clone().requires_grad_()
    t = 1 + int(lens.max())
    pos = torch.arange(t)
    completion_mask = ((pos >= 1) & (pos <= lens[:, None])).long()  # (B, T) position 0 is the prompt
    per_token = completion_mask[:, 1:] * (x / lens)[:, None]  # (B, T-1)
    zeros = torch.zeros_like(per_token)
    outputs = SimpleNamespace(log_probs=per_token, entropy=zeros, mean_logits=zeros)
    calculate_kl = loss_type != "apo_zero_unpaired"
    stub = SimpleNamespace(
        model=SimpleNamespace(training=True), aux_loss_enabled=False, precompute_ref_logps=True,
        accelerator=SimpleNamespace(device="cpu", gather_for_metrics=lambda v: v), calculate_KL=calculate_kl,
        loss_type=loss_type, beta=beta, desirable_weight=dw, undesirable_weight=uw,
        _compute_kl_logps=lambda model, batch: kl if calculate_kl else None,
        _metrics={"train": defaultdict(list)}, _total_train_tokens=0, _tp_size=1)
    inputs = {"input_ids": torch.zeros_like(completion_mask), "attention_mask": torch.ones_like(completion_mask),
              "completion_mask": completion_mask, "label": labels, "ref_logps": ref, "ref_KL_logps": ref_kl}
    loss = KTOTrainer._compute_loss(stub, lambda **kw: outputs, inputs, return_outputs=False)
    loss.backward()
    return loss.detach(), x.grad, {k: v[-1] for k, v in stub._metrics["train"].items()}


def _ours(logps, ref, labels, kl, ref_kl, *, beta, dw, uw, loss_type):
    x = logps.clone().requires_grad_()
    loss, m = kto_loss(x, ref, labels, kl, ref_kl, beta=beta, desirable_weight=dw, undesirable_weight=uw,
                       loss_type=loss_type)
    loss.backward()
    return loss.detach(), x.grad, m


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
@pytest.mark.parametrize("beta, dw, uw", [(0.1, 1.0, 1.0), (0.5, 1.33, 0.7)])
def test_matches_trl(loss_type, beta, dw, uw):
    pytest.importorskip("trl")
    logps, ref, labels, kl, ref_kl, lens = _batch(0)
    ours = _ours(logps, ref, labels, kl, ref_kl, beta=beta, dw=dw, uw=uw, loss_type=loss_type)
    trl = _trl(logps, ref, labels, kl, ref_kl, lens, beta=beta, dw=dw, uw=uw, loss_type=loss_type)
    torch.testing.assert_close(ours[0], trl[0], rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(ours[1], trl[1], rtol=1e-10, atol=1e-14)
    assert ours[1].abs().min() > 0  # every row has a gradient: the comparison is not vacuous
    if loss_type == "kto":
        assert ours[2]["kl"] > 0.1  # z is in play
    assert set(ours[2]) == NAMES and NAMES <= set(trl[2])
    assert ours[2] == pytest.approx({k: trl[2][k] for k in NAMES}, rel=1e-12, abs=1e-12)


def test_matches_trl_when_z_clamps_and_with_one_label():
    pytest.importorskip("trl")
    logps, ref, labels, kl, ref_kl, lens = _batch(3)
    ref_kl = kl + 1.0  # mean log-ratio -1: z clamps to 0
    for lab in (labels, torch.ones_like(labels)):
        ours = _ours(logps, ref, lab, kl, ref_kl, beta=0.3, dw=1.0, uw=1.0, loss_type="kto")
        trl = _trl(logps, ref, lab, kl, ref_kl, lens, beta=0.3, dw=1.0, uw=1.0, loss_type="kto")
        torch.testing.assert_close(ours[0], trl[0], rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(ours[1], trl[1], rtol=1e-10, atol=1e-14)
        assert ours[2]["kl"] == trl[2]["kl"] == 0.0
        assert set(ours[2]) == set(trl[2]) & NAMES  # one label: no metrics of the other, no margins
        assert ours[2] == pytest.approx({k: trl[2][k] for k in ours[2]}, rel=1e-12, abs=1e-12)


# ------------------------------------------------------------------ invariance


def test_micro_batches_and_ranks_give_the_whole_batch_update():
    """z over the whole batch (summed log-ratios of every part) and each part's loss divided by the
    whole B: the parts' losses and gradients add up to the whole batch's, and so do partial metrics."""
    logps, ref, labels, kl, ref_kl, _ = _batch(1)
    whole = _ours(logps, ref, labels, kl, ref_kl, beta=0.2, dw=1.2, uw=0.9, loss_type="kto")
    B = logps.numel()
    x = logps.clone().requires_grad_()
    z = kto_reference_point(sum((kl[p] - ref_kl[p]).sum() for p in (slice(0, 3), slice(3, B))), B)
    total, metrics = 0.0, defaultdict(float)
    counts = (int(labels.sum()), int((~labels).sum()))
    for part in (slice(0, 3), slice(3, 5), slice(5, B)):  # uneven parts
        loss, m = kto_loss(x[part], ref[part], labels[part], None, None, beta=0.2, desirable_weight=1.2,
                           undesirable_weight=0.9, kl=z, normaliser=B, counts=counts)
        loss.backward()
        total += loss.item()
        assert m == kto_metrics(logps[part], ref[part], labels[part], z, beta=0.2, counts=counts)
        for k, v in m.items():
            metrics[k] += v if k != "kl" else v * (part.stop - part.start) / B
    assert total == pytest.approx(whole[0].item(), rel=1e-12)
    torch.testing.assert_close(x.grad, whole[1], rtol=1e-12, atol=1e-15)
    assert dict(metrics) == pytest.approx(whole[2], rel=1e-12)


# ------------------------------------------------------------------ TRL's weight advice


def test_weight_advice_follows_trl():
    # equal counts: never; 261 desirable vs 1008 undesirable with weights 1: advice to raise λ_D
    assert weight_advice(50, 50, 1.0, 5.0) is None
    advice = weight_advice(261, 1008, 1.0, 1.0)
    assert "kto.desirable_weight in [3.86, 5.14]" in advice and "kto.undesirable_weight in [0.19, 0.26]" in advice
    assert weight_advice(261, 1008, 4.0, 1.0) is None  # 4.0 in [3.86, 5.14]
    assert weight_advice(261, 1008, 1.0, 0.2) is None  # 0.2 in [0.19, 0.26]
    assert weight_advice(100, 90, 1.0, 1.0) is None  # λ_D n_D / (λ_U n_U) = 1.11 is in [1, 4/3]
