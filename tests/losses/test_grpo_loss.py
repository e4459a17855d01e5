"""grpo_loss: hand-worked values, parity with TRL 1.16's real loss code, micro-batch invariance."""
from __future__ import annotations

import itertools
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from preftune.losses import grpo_loss
from preftune.losses.grpo import LOSS_TYPES, VESPO_DEFAULTS, batch_normaliser

trl = pytest.importorskip("trl")
from trl import GRPOTrainer  # noqa: E402

F64 = torch.float64
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=F64)  # row 0 has 2 tokens, row 1 has 1


def _leaf(x):
    return torch.tensor(x, dtype=F64, requires_grad=True)


def _loss_and_grad(logps_values, *args, **kwargs):
    logps = _leaf(logps_values)
    loss, metrics = grpo_loss(logps, *args, **kwargs)
    loss.backward()
    return loss.item(), logps.grad, metrics


# ---------------------------------------------------------------- 1. hand-worked values

ON_POLICY = [[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5]]
ADV = torch.tensor([1.0, -0.5], dtype=F64)


@pytest.mark.parametrize(
    "loss_type, kwargs, expected, grad",
    [
        # On-policy r = 1 everywhere, so each token's term is -A_i: row 0 -> -1, row 1 -> +0.5.
        # grpo: mean over rows of the per-row token mean = (-1 + 0.5) / 2 = -0.25;
        # d/dlogp = -A_i * r / |o_i| / B: row 0 -> -1/2/2 = -0.25, row 1 -> 0.5/1/2 = 0.25.
        ("grpo", {}, -0.25, [[-0.25, -0.25, 0], [0.25, 0, 0]]),
        # dapo: token sum / num tokens = (-1 - 1 + 0.5) / 3 = -0.5; grad -A_i / 3.
        ("dapo", {}, -0.5, [[-1 / 3, -1 / 3, 0], [0.5 / 3, 0, 0]]),
        # dapo with num_items=6 (the whole generation batch has 6 tokens): -1.5 / 6 = -0.25.
        ("dapo", {"num_items": 6}, -0.25, [[-1 / 6, -1 / 6, 0], [0.5 / 6, 0, 0]]),
        # bnpo: token mean of this batch, same as dapo here: -0.5.
        ("bnpo", {}, -0.5, [[-1 / 3, -1 / 3, 0], [0.5 / 3, 0, 0]]),
        # dr_grpo with L_max = 4: token sum / (B * L_max) = -1.5 / 8 = -0.1875; grad -A_i / 8.
        ("dr_grpo", {"max_completion_length": 4}, -0.1875, [[-1 / 8, -1 / 8, 0], [0.5 / 8, 0, 0]]),
    ],
)
def test_on_policy_hand_values(loss_type, kwargs, expected, grad):
    loss, g, metrics = _loss_and_grad(ON_POLICY, None, None, ADV, MASK, loss_type=loss_type, **kwargs)
    assert loss == pytest.approx(expected, abs=1e-12)
    torch.testing.assert_close(g, torch.tensor(grad, dtype=F64), rtol=0, atol=1e-12)
    assert metrics["kl"] == 0.0 and metrics["clip_ratio/region_mean"] == 0.0


# Off-policy: ratios r = [[1.5, 0.9, 1], [0.5, 1, 1]] against old log-probs of -1; A = [1, -1].
OLD = torch.full((2, 3), -1.0, dtype=F64)
RATIOS = [[1.5, 0.9, 1.0], [0.5, 1.0, 1.0]]
OFF_POLICY = (OLD + torch.tensor(RATIOS, dtype=F64).log()).tolist()
ADV_PM = torch.tensor([1.0, -1.0], dtype=F64)


def test_clipped_dapo_hand_values():
    # eps = 0.2: row 0 t0 r=1.5, A=+1 -> min(1.5, 1.2) = 1.2, term -1.2, clipped (grad 0);
    # row 0 t1 r=0.9 -> term -0.9, grad -A*r/3 = -0.3; row 1 t0 r=0.5, A=-1 -> min(-0.5, -0.8)
    # = -0.8, term +0.8, clipped. Loss = (-1.2 - 0.9 + 0.8) / 3 = -1.3 / 3.
    loss, g, m = _loss_and_grad(OFF_POLICY, OLD, None, ADV_PM, MASK, loss_type="dapo")
    assert loss == pytest.approx(-1.3 / 3, abs=1e-12)
    torch.testing.assert_close(g, torch.tensor([[0, -0.3, 0], [0, 0, 0]], dtype=F64), rtol=0, atol=1e-12)
    # One low-clipped and one high-clipped token out of 3; per row: low [0, 1], high [1/2, 0].
    assert m["clip_ratio/low_mean"] == pytest.approx(1 / 3)
    assert m["clip_ratio/high_mean"] == pytest.approx(1 / 3)
    assert m["clip_ratio/region_mean"] == pytest.approx(2 / 3)
    assert m["clip_ratio/low_min"] == 0.0 and m["clip_ratio/high_max"] == pytest.approx(0.5)


def test_clip_higher_and_two_sided_delta_hand_values():
    # eps_high = 0.6: r = 1.5 < 1.6 is no longer clipped: term -1.5, grad -1.5 / 3 = -0.5.
    # Loss = (-1.5 - 0.9 + 0.8) / 3 = -1.6 / 3.
    loss, g, m = _loss_and_grad(OFF_POLICY, OLD, None, ADV_PM, MASK, loss_type="dapo", epsilon_high=0.6)
    assert loss == pytest.approx(-1.6 / 3, abs=1e-12)
    assert g[0, 0].item() == pytest.approx(-0.5, abs=1e-12)
    assert m["clip_ratio/high_mean"] == 0.0
    # delta = 1.3 caps the unclipped ratio: min(min(1.5, 1.3), clip(1.5, 0.8, 1.6)) = 1.3, grad 0.
    # Loss = (-1.3 - 0.9 + 0.8) / 3 = -1.4 / 3.
    loss, g, _ = _loss_and_grad(OFF_POLICY, OLD, None, ADV_PM, MASK, loss_type="dapo", epsilon_high=0.6, delta=1.3)
    assert loss == pytest.approx(-1.4 / 3, abs=1e-12)
    assert g[0, 0].item() == 0.0


def test_gspo_sequence_ratio_hand_values():
    # Row 0: s = exp(mean(log 1.5, log 0.9)) = sqrt(1.35) in [0.8, 1.2], A=+1 -> each token -s.
    # Row 1: s = 0.5, A=-1 -> clipped to 0.8 -> +0.8. grpo: (-sqrt(1.35) + 0.8) / 2.
    # Grad on row 0 tokens: d(-s)/dlogp_t = -s / 2 (mean over 2 tokens), then / B = 2 -> -s / 4.
    s = math.sqrt(1.35)
    loss, g, m = _loss_and_grad(
        OFF_POLICY, OLD, None, ADV_PM, MASK, loss_type="grpo", importance_sampling_level="sequence"
    )
    assert loss == pytest.approx((-s + 0.8) / 2, abs=1e-12)
    torch.testing.assert_close(g, torch.tensor([[-s / 4, -s / 4, 0], [0, 0, 0]], dtype=F64), rtol=0, atol=1e-12)
    # Sequence level counts sequences: 1 of 2 is low-clipped.
    assert m["clip_ratio/low_mean"] == pytest.approx(0.5) and m["clip_ratio/high_mean"] == 0.0


def test_luspo_hand_values():
    # LUSPO: each sequence's token sum, then the mean over sequences. On-policy the per-token term is
    # -A_i: row 0 sums to -2 (2 tokens), row 1 to +0.5 -> (-2 + 0.5) / 2 = -0.75; d/dlogp = -A_i / B.
    for level in ("token", "sequence"):  # on-policy the sequence ratio's gradient spreads 1/|o_i| per token,
        loss, g, _ = _loss_and_grad(ON_POLICY, None, None, ADV, MASK, loss_type="luspo",  # times |o_i| tokens
                                    importance_sampling_level=level)
        assert loss == pytest.approx(-0.75, abs=1e-12)
        torch.testing.assert_close(g, torch.tensor([[-0.5, -0.5, 0], [0.25, 0, 0]], dtype=F64), rtol=0, atol=1e-12)


def test_vespo_hand_values():
    # Sequence ratios w = 1.5 * 0.9 = 1.35 (row 0, A = +1: k = 2, lambda = 3) and 0.5 (row 1, A = -1:
    # k = 3, lambda = 2). phi = exp(lambda + k ln w - lambda w): 1.35^2 e^(3 - 4.05) and 0.5^3 e^(2 - 1).
    phi0, phi1 = 1.35 ** 2 * math.exp(3 - 4.05), 0.5 ** 3 * math.exp(2 - 1)
    lp = torch.tensor(OFF_POLICY, dtype=F64)
    # loss = sum_t m (-phi A log pi) / 3 tokens; phi carries no gradient, so d/dlogp = -phi A / 3.
    expected = (-phi0 * (lp[0, 0] + lp[0, 1]) + phi1 * lp[1, 0]).item() / 3
    loss, g, m = _loss_and_grad(OFF_POLICY, OLD, None, ADV_PM, MASK, loss_type="vespo")
    assert loss == pytest.approx(expected, abs=1e-12)
    torch.testing.assert_close(g, torch.tensor([[-phi0 / 3, -phi0 / 3, 0], [phi1 / 3, 0, 0]], dtype=F64),
                               rtol=0, atol=1e-12)
    assert m["vespo/phi_seq_mean"] == pytest.approx((phi0 + phi1) / 2, abs=1e-12)
    assert m["clip_ratio/region_mean"] == 0.0  # a smooth gate: nothing is hard-clipped


def test_vespo_folds_engine_weights_into_phi():
    # On-policy (w = 1) with the engine's weight rho = 2 on row 0's first token: w = 2, phi = 2^2 e^(3 - 6),
    # and the weight is not multiplied into the loss a second time. Row 1: w = 1, phi = 1.
    rho = torch.tensor([[2.0, 1.0, 1.0], [1.0, 1.0, 1.0]], dtype=F64)
    _, _, m = _loss_and_grad(ON_POLICY, None, None, ADV, MASK, loss_type="vespo", importance_weights=rho)
    assert m["vespo/phi_seq_mean"] == pytest.approx((4 * math.exp(-3) + 1) / 2, abs=1e-12)
    _, g, _ = _loss_and_grad(ON_POLICY, None, None, ADV, MASK, loss_type="vespo", importance_weights=rho)
    assert g[0, 0].item() == pytest.approx(-4 * math.exp(-3) / 3, abs=1e-12)


def test_kl_hand_values():
    # A = 0, so only beta * k3 remains; d = ref - logp = [[ln 2, 0, *], [-ln 2, *, *]].
    # k3 = e^d - d - 1: ln 2 -> 1 - ln 2; 0 -> 0; -ln 2 -> ln 2 - 1/2. Sum = 1/2.
    # dapo, beta = 0.1: 0.1 * (1/2) / 3. dk3/dlogp = 1 - e^d: -1, 0, +1/2, times beta / 3.
    logps = torch.tensor(ON_POLICY, dtype=F64)
    ref = logps + torch.tensor([[math.log(2), 0, 5], [-math.log(2), 7, 9]], dtype=F64)
    loss, g, m = _loss_and_grad(ON_POLICY, None, ref, torch.zeros(2, dtype=F64), MASK, beta=0.1)
    assert loss == pytest.approx(0.1 * 0.5 / 3, abs=1e-12)
    torch.testing.assert_close(
        g, torch.tensor([[-0.1 / 3, 0, 0], [0.05 / 3, 0, 0]], dtype=F64), rtol=0, atol=1e-12
    )
    assert m["kl"] == pytest.approx(0.5 / 3, abs=1e-12)


def test_bool_mask_matches_float_mask():
    a = _loss_and_grad(OFF_POLICY, OLD, None, ADV_PM, MASK, loss_type="grpo")
    b = _loss_and_grad(OFF_POLICY, OLD, None, ADV_PM, MASK.bool(), loss_type="grpo")
    assert a[0] == b[0]
    torch.testing.assert_close(a[1], b[1])


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_all_padding_batch_gives_zero_loss_not_nan(loss_type):
    logps = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    loss, metrics = grpo_loss(logps, None, logps.detach() - 1, ADV, torch.zeros(2, 3), loss_type=loss_type,
                              beta=0.1, epsilon_high=2.0)
    loss.backward()
    assert loss.item() == 0.0 and not torch.isnan(logps.grad).any()
    assert metrics["kl"] == 0.0


def test_bfloat16_inputs_are_computed_in_float32():
    logps = torch.tensor(OFF_POLICY, dtype=F64)
    ref, _, _ = _loss_and_grad(OFF_POLICY, OLD, None, ADV_PM, MASK, loss_type="grpo")
    loss, _ = grpo_loss(logps.bfloat16(), OLD.bfloat16(), None, ADV_PM.bfloat16(), MASK.bool(), loss_type="grpo")
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(ref, abs=2e-2)  # bf16 rounding of the inputs only


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"loss_type": "ppo"}, "grpo, bnpo, dr_grpo, dapo"),
        ({"importance_sampling_level": "batch"}, "token, sequence"),
        ({"beta": 0.1}, "ref_logps"),
        ({"loss_type": "cispo"}, "epsilon_high"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    logps = torch.zeros(2, 3, dtype=F64)
    with pytest.raises(ValueError, match=match):
        grpo_loss(logps, None, None, ADV, MASK, **kwargs)


# ---------------------------------------------------------------- 2. parity with TRL 1.16


def _trl_loss(logps, old, ref, adv, mask, *, loss_type, beta, epsilon, epsilon_high, delta, level,
              max_completion_length, num_items, bias_correction, tau_pos=1.0, tau_neg=1.05, vespo=None):
    """Run TRL's GRPOTrainer._compute_loss on a stand-in trainer whose model 'returns' `logps`."""
    metrics = defaultdict(lambda: defaultdict(list))
    batch, length = logps.shape
    stub = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False, top_entropy_quantile=1.0, off_policy_mask_threshold=None,
        importance_sampling_level=level, beta=beta, loss_type=loss_type, epsilon_low=epsilon,
        epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        use_vllm=False, vllm_importance_sampling_correction=False, _entropy_bonus_enabled=False,
        model=SimpleNamespace(training=True), current_gradient_accumulation_steps=1,
        max_completion_length=max_completion_length, _metrics=metrics,
        accelerator=SimpleNamespace(num_processes=1, gather=lambda t: t, reduce=lambda t, reduction: t),
        args=SimpleNamespace(delta=delta, use_bias_correction_kl=bias_correction, steps_per_generation=1,
                             sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg,
                             **{f"vespo_{k}": v for k, v in (vespo or VESPO_DEFAULTS).items()}),
        get_gamma_weights=GRPOTrainer.get_gamma_weights,
    )
    inputs = {
        "prompt_ids": torch.zeros(batch, 1, dtype=torch.long), "prompt_mask": torch.ones(batch, 1, dtype=torch.long),
        "completion_ids": torch.zeros(batch, length, dtype=torch.long), "completion_mask": mask,
        "advantages": adv, "num_items_in_batch": torch.tensor(float(num_items), dtype=F64),
    }
    if old is not None:
        inputs["old_per_token_logps"] = old
    if ref is not None:
        inputs["ref_per_token_logps"] = ref
    loss = GRPOTrainer._compute_loss(stub, None, inputs)
    return loss, {k: v[-1] for k, v in metrics["train"].items()}


def _random_batch(seed, batch=5, length=6):
    g = torch.Generator().manual_seed(seed)
    logps = -torch.rand(batch, length, generator=g, dtype=F64) * 3  # (B, T)
    old = logps + 0.3 * torch.randn(batch, length, generator=g, dtype=F64)  # ratios ~ 0.6 .. 1.6
    ref = logps + 0.5 * torch.randn(batch, length, generator=g, dtype=F64)
    adv = torch.randn(batch, generator=g, dtype=F64)  # (B,)
    lengths = torch.tensor([length, 4, 1, 0, 3][:batch])  # right padding, one empty completion
    mask = (torch.arange(length)[None, :] < lengths[:, None]).to(F64)  # (B, T)
    return logps, old, ref, adv, mask


def _cases():
    for loss_type, level, beta, on_policy in itertools.product(
        LOSS_TYPES, ("token", "sequence"), (0.0, 0.04), (True, False)
    ):
        clip_opts = [(None, None), (0.28, None), (0.28, 1.5)] if loss_type in ("grpo", "dapo") else [(None, None)]
        if loss_type == "cispo":
            clip_opts = [(1.2, None)]  # epsilon_high is the absolute cap here
        for epsilon_high, delta in clip_opts:
            for bias in (False, True) if beta else (False,):
                yield loss_type, level, beta, on_policy, epsilon_high, delta, bias


@pytest.mark.parametrize("loss_type, level, beta, on_policy, epsilon_high, delta, bias", list(_cases()))
def test_matches_trl(loss_type, level, beta, on_policy, epsilon_high, delta, bias):
    logps, old, ref, adv, mask = _random_batch(seed=2 * LOSS_TYPES.index(loss_type) + (level == "sequence"))
    old = None if on_policy else old
    ref = ref if beta else None
    opts = dict(loss_type=loss_type, beta=beta, epsilon=0.2, epsilon_high=epsilon_high, delta=delta,
                max_completion_length=8, num_items=13.0)
    # TRL builds the SAPO temperatures as float32 tensors; use values float32 holds exactly.
    taus = dict(tau_pos=1.0, tau_neg=1.25)
    mine = logps.clone().requires_grad_()
    loss, metrics = grpo_loss(mine, old, ref, adv, mask, importance_sampling_level=level, kl_ratio_correction=bias,
                              sapo_temperature_pos=taus["tau_pos"], sapo_temperature_neg=taus["tau_neg"], **opts)
    loss.backward()
    theirs = logps.clone().requires_grad_()
    trl_loss, trl_metrics = _trl_loss(theirs, old, ref, adv, mask, level=level, bias_correction=bias, **taus, **opts)
    trl_loss.backward()

    assert loss.item() == pytest.approx(trl_loss.item(), abs=1e-8)
    torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-8)
    if beta:
        assert metrics["kl"] == pytest.approx(trl_metrics["kl"], abs=1e-8)
    if loss_type == "cispo":
        assert metrics["clip_ratio/high_mean"] == pytest.approx(trl_metrics["cispo_clip_ratio"], abs=1e-7)
    elif loss_type == "vespo":
        assert metrics["vespo/phi_seq_mean"] == pytest.approx(trl_metrics["vespo/phi_seq_mean"], abs=1e-8)
    elif loss_type != "sapo":
        for key in ("low_mean", "high_mean", "region_mean", "low_min", "high_max"):
            assert metrics[f"clip_ratio/{key}"] == pytest.approx(trl_metrics[f"clip_ratio/{key}"], abs=1e-7), key


def test_sapo_default_temperatures_match_trl_up_to_float32_tau():
    # TRL rounds tau_neg = 1.05 to float32 (1.0499999523...); we keep logps' dtype, so the two
    # agree only to ~1e-8 relative. Anything larger would be a real formula difference.
    logps, old, _, adv, mask = _random_batch(seed=3)
    mine, _ = grpo_loss(logps, old, None, adv, mask, loss_type="sapo")
    theirs, _ = _trl_loss(logps, old, None, adv, mask, loss_type="sapo", beta=0.0, epsilon=0.2, epsilon_high=None,
                          delta=None, level="token", max_completion_length=None, num_items=1, bias_correction=False)
    assert mine.item() == pytest.approx(theirs.item(), rel=1e-6)


def test_trl_parity_cases_exercise_clipping():
    """Guard against a vacuous parity test: the random batches do clip on both sides."""
    logps, old, _, adv, mask = _random_batch(seed=0)
    _, m = grpo_loss(logps, old, None, adv, mask)
    assert m["clip_ratio/low_mean"] > 0 and m["clip_ratio/high_mean"] > 0


# ---------------------------------------------------------------- 3. micro-batch invariance


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_microbatch_split_equals_one_pass(loss_type, level):
    logps, old, ref, adv, mask = _random_batch(seed=7, batch=5, length=6)
    logps, old, ref = (torch.cat([x, x.flip(0)]) for x in (logps, old, ref))  # B = 10
    adv, mask = torch.cat([adv, -adv.flip(0)]), torch.cat([mask, mask.flip(0)])
    opts = dict(loss_type=loss_type, beta=0.05, epsilon_high=1.3 if loss_type == "cispo" else 0.28,
                importance_sampling_level=level, max_completion_length=6)
    total_tokens = mask.sum().item()

    whole = logps.clone().requires_grad_()
    full, _ = grpo_loss(whole, old, ref, adv, mask, num_items=total_tokens, **opts)
    full.backward()

    parts = logps.clone().requires_grad_()
    split_sum = 0.0
    norm = batch_normaliser(loss_type, batch_seqs=mask.shape[0], batch_tokens=total_tokens, max_completion_length=6)
    for lo, hi in [(0, 3), (3, 4), (4, 10)]:  # uneven micro-batches
        # Trim each micro-batch to its own longest completion, as a padding-aware loop would.
        t = max(int(mask[lo:hi].sum(-1).max().item()), 1)
        mb = slice(lo, hi)
        loss, _ = grpo_loss(parts[mb, :t], old[mb, :t], ref[mb, :t], adv[mb], mask[mb, :t], normaliser=norm, **opts)
        loss.backward()
        split_sum += loss.item()

    assert split_sum == pytest.approx(full.item(), abs=1e-10)
    torch.testing.assert_close(parts.grad, whole.grad, rtol=0, atol=1e-10)
    assert whole.grad.abs().sum() > 0


def test_batch_normaliser_rejects_unknown_loss():
    with pytest.raises(ValueError, match="dapo"):
        batch_normaliser("ppo", batch_seqs=2, batch_tokens=3, max_completion_length=4)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_bnpo_over_a_whole_batch_is_dapo(level):
    """With the whole batch's normaliser, bnpo and dapo are one update (the same surrogate and token sum)."""
    logps, old, ref, adv, mask = _random_batch(seed=3, batch=5, length=5)
    grads = []
    for loss_type in ("bnpo", "dapo"):
        x = logps.clone().requires_grad_()
        norm = batch_normaliser(loss_type, batch_seqs=5, batch_tokens=mask.sum().item(), max_completion_length=5)
        loss, _ = grpo_loss(x, old, ref, adv, mask, loss_type=loss_type, beta=0.05, importance_sampling_level=level,
                            normaliser=norm)
        loss.backward()
        grads.append((loss.detach(), x.grad))
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=0)
