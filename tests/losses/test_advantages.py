"""group_advantages / group_spread: hand values, NaN rows, and parity with TRL 1.16's trainer code."""
from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from preftune.losses.advantages import group_advantages, group_spread

NAN = float("nan")
F64 = torch.float64


def _group_mean(r: torch.Tensor, g) -> torch.Tensor:
    """Each valid row's group mean (N,), read back from the centred advantages."""
    return r - group_advantages(r, g, scale_rewards="none")


def test_hand_values_group_scale():
    # Group 0 = [1, 0, 0, 1]: mean 0.5, Bessel std = sqrt(4 * 0.25 / 3) = sqrt(1/3).
    # A = +-0.5 / (sqrt(1/3) + 1e-4). Group 1 = [2, 2, 2, 2]: zero std -> A = 0 / 1e-4 = 0.
    r = torch.tensor([1.0, 0, 0, 1, 2, 2, 2, 2], dtype=F64)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    expected = torch.tensor([a, -a, -a, a, 0, 0, 0, 0], dtype=F64)
    torch.testing.assert_close(group_advantages(r, 4), expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(_group_mean(r, 4), torch.tensor([0.5] * 4 + [2.0] * 4, dtype=F64))
    torch.testing.assert_close(group_spread(r, 4), torch.tensor([math.sqrt(1 / 3), 0.0], dtype=F64))


def test_hand_values_batch_and_none_scale():
    # Groups [0, 2] and [4, 8]: means 1 and 6, centred [-1, 1, -2, 2].
    # Batch std of [0, 2, 4, 8] (mean 3.5): sqrt((12.25 + 2.25 + 0.25 + 20.25) / 3) = sqrt(35/3).
    r = torch.tensor([0.0, 2, 4, 8], dtype=F64)
    centred = torch.tensor([-1.0, 1, -2, 2], dtype=F64)
    torch.testing.assert_close(group_advantages(r, 2, scale_rewards="none"), centred)
    batch = group_advantages(r, 2, scale_rewards="batch")
    torch.testing.assert_close(batch, centred / (math.sqrt(35 / 3) + 1e-4), rtol=0, atol=1e-12)
    # Per-group scaling would give both groups the same +-1/sqrt(2)-ish magnitude instead.
    group = group_advantages(r, 2, scale_rewards="group")
    assert group[0].item() == pytest.approx(group[2].item(), rel=1e-3)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_nan_rows_get_zero_and_do_not_shift_their_group(scale):
    r = torch.tensor([1.0, NAN, 3.0, 8.0, 0.0, 5.0, 1.0, 2.0], dtype=F64)
    adv = group_advantages(r, 4, scale_rewards=scale)
    assert adv[1].item() == 0.0 and not torch.isnan(adv).any()
    if scale != "batch":  # batch std spans groups, so dropping the row from group 0 alone differs
        alone = group_advantages(torch.tensor([1.0, 3.0, 8.0], dtype=F64), 3, scale_rewards=scale)
        torch.testing.assert_close(adv[[0, 2, 3]], alone)
    assert _group_mean(r, 4)[0].item() == pytest.approx(4.0)  # (1 + 3 + 8) / 3, NaN left out


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_single_valid_row_and_all_nan_groups_give_zero(scale):
    r = torch.tensor([NAN, 5.0, NAN, NAN, NAN, NAN, 1.0, 2.0], dtype=F64)
    adv = group_advantages(r, 2, scale_rewards=scale)
    assert adv[:6].tolist() == [0.0] * 6
    assert adv[6].item() < 0 < adv[7].item()
    assert group_spread(r, 2)[:3].tolist() == [0.0] * 3  # < 2 rewards: no spread, no signal


def test_one_generation_per_prompt_gives_zero():
    assert group_advantages(torch.tensor([1.0, 7.0]), 1).tolist() == [0.0, 0.0]


@pytest.mark.parametrize(
    "rewards, g, kwargs, match",
    [
        (torch.zeros(5), 2, {}, "groups"),
        (torch.zeros(2, 2), 2, {}, "1-D"),
        (torch.tensor([1.0, math.inf]), 2, {}, "finite"),
        (torch.zeros(4), 2, {"scale_rewards": "global"}, "group, batch, none"),
    ],
)
def test_bad_inputs_raise(rewards, g, kwargs, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(rewards, g, **kwargs)


# ---------------------------------------------------------------- parity with TRL 1.16


def _trl_advantages(rewards: torch.Tensor, num_generations: int, scale: str):
    """Run GRPOTrainer._generate_and_score_completions on a stand-in trainer: generation is faked,
    the single reward function returns `rewards` (NaN = None), and we read TRL's advantages."""
    from trl import GRPOTrainer

    n = rewards.numel()
    metrics = defaultdict(lambda: defaultdict(list))
    stub = SimpleNamespace(
        accelerator=SimpleNamespace(device="cpu", process_index=0, gather=lambda t: t),
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False),
        environment_factories=None, environments=None, tools=None, use_vllm=False,
        vllm_importance_sampling_correction=False, mask_truncated_completions=False, beta=0.0,
        pad_to_multiple_of=None, _tokenizer=SimpleNamespace(pad_token_id=0), num_iterations=1,
        args=SimpleNamespace(per_device_train_batch_size=n, steps_per_generation=1, gradient_accumulation_steps=1,
                             gradient_checkpointing_kwargs=None),
        _generate=lambda prompts: ([[1]] * n, [[2, 3]] * n, None, ["c"] * n, None, {}, None, None),
        _calculate_rewards=lambda *a: rewards.unsqueeze(1).clone(),  # (N, 1): one reward function
        num_generations=num_generations, multi_objective_aggregation="sum_then_normalize",
        reward_weights=torch.ones(1, dtype=rewards.dtype), scale_rewards=scale, reward_func_names=["r"],
        _metrics=metrics, _pending_extra_logs={}, _pending_metrics={},
        _logs={"prompt": [], "completion": [], "advantages": [], "rewards": defaultdict(list),
               "extra": defaultdict(list)},
    )
    out = GRPOTrainer._generate_and_score_completions(stub, [{"prompt": "p"}] * n)
    return out["advantages"], metrics["train"]["frac_reward_zero_std"][-1]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_matches_trl(scale):
    pytest.importorskip("trl")
    g = torch.Generator().manual_seed(0)
    rewards = torch.randn(24, generator=g, dtype=F64)  # 6 groups of 4
    rewards[4:8] = 0.5  # a zero-std group
    rewards[[1, 9, 10]] = NAN  # unscorable rows, two in one group
    rewards[13:16] = NAN  # a group with one valid reward
    ours = group_advantages(rewards, 4, scale_rewards=scale)
    theirs, frac_zero_std = _trl_advantages(rewards, 4, scale)
    # TRL's nanstd forms the Bessel factor n / (n - 1) from integer counts in float32, so
    # float64 results agree to ~1e-8 relative, not to float64 precision.
    torch.testing.assert_close(ours, theirs.to(F64), rtol=1e-7, atol=1e-7)
    assert (ours != 0).sum() >= 12  # the comparison is not vacuous
    if scale != "batch":  # TRL's batch mode logs whether the single batch std is zero instead
        # the metric as the GRPO step logs it: a group with one valid reward has no std (TRL: not zero)
        from preftune.algorithms.grpo import reward_metrics
        from preftune.rollout.scored import Scored

        scored = Scored(None, rewards.unsqueeze(1), rewards, ["r"], [4] * 6)
        m = reward_metrics(scored, torch.full((24,), 2.0), torch.zeros(24, dtype=torch.bool))
        assert m["frac_reward_zero_std"] == pytest.approx(frac_zero_std) and frac_zero_std == pytest.approx(1 / 6)


def test_unequal_groups_equal_each_group_alone():
    """Offline groups of different sizes: one call, the same as each group normalised by itself."""
    from preftune.losses.advantages import nanmean

    groups = [[1.0, 0.0, 0.5], [0.2, float("nan"), 0.9], [0.3, 0.3, 0.6, 0.0, 1.0]]
    flat = torch.tensor([r for g in groups for r in g], dtype=F64)
    sizes = [len(g) for g in groups]
    for scale in ("group", "none"):
        alone = torch.cat([group_advantages(torch.tensor(g, dtype=F64), len(g), scale_rewards=scale) for g in groups])
        torch.testing.assert_close(group_advantages(flat, sizes, scale_rewards=scale), alone, rtol=0, atol=1e-12)
    valid = flat[~flat.isnan()]
    centred = group_advantages(flat, sizes, scale_rewards="none")
    torch.testing.assert_close(group_advantages(flat, sizes, scale_rewards="batch"), centred / (valid.std() + 1e-4))
    assert _group_mean(flat, sizes)[3].item() == pytest.approx(0.55)
    spread = group_spread(flat, sizes)  # (3,)
    assert spread[1].item() == pytest.approx(0.7 / 2 ** 0.5) and spread.shape == (3,)
    assert group_spread(torch.tensor([1.0, 1.0, float("nan"), 2.0]), [2, 2]).tolist() == [0.0, 0.0]
    assert nanmean(flat) == pytest.approx(valid.mean().item()) and math.isnan(nanmean(torch.tensor([float("nan")])))
    with pytest.raises(ValueError, match="do not cover"):
        group_advantages(flat, [3, 3])


# ---------------------------------------------------------------- estimators: rloo, reinforce_plus_plus_baseline


def test_rloo_hand_values():
    # Group [1, 0, 0, 1]: baselines are the others' means [1/3, 2/3, 2/3, 1/3] -> A = [2/3, -2/3, -2/3, 2/3]
    # (= 4/3 (r - 0.5)). Group [3, NaN, 6]: valid [3, 6], baselines [6, 3] -> A = [-3, 0, 3].
    # Group [5, NaN, NaN]: a lone reward is its own baseline -> 0.
    r = torch.tensor([1.0, 0, 0, 1, 3, NAN, 6, NAN, 5, NAN, NAN, NAN], dtype=F64)
    adv = group_advantages(r, [4, 3, 3, 2], estimator="rloo")
    expected = torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, -3, 0, 3, 0, 0, 0, 0, 0], dtype=F64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)
    for scale in ("group", "batch", "none"):  # the grpo estimator's divisor only
        torch.testing.assert_close(group_advantages(r, [4, 3, 3, 2], estimator="rloo", scale_rewards=scale), adv)


def test_reinforce_plus_plus_baseline_hand_values():
    # Groups [0, 2] and [4, 8]: centred c = [-1, 1, -2, 2], batch mean 0, Bessel std sqrt(10/3);
    # the lone 7 (group [7, NaN]) is its own baseline: A = 0 and it is left out of the whitening.
    r = torch.tensor([0.0, 2, 4, 8, 7, NAN], dtype=F64)
    adv = group_advantages(r, 2, estimator="reinforce_plus_plus_baseline")
    c = torch.tensor([-1.0, 1, -2, 2], dtype=F64)
    torch.testing.assert_close(adv[:4], c / (math.sqrt(10 / 3) + 1e-4), rtol=0, atol=1e-12)
    assert adv[4:].tolist() == [0.0, 0.0]
    # unequal groups: the whitening subtracts the batch mean of c, which is 0 here only by symmetry;
    # [1, 2, 6] centres to [-2, -1, 3] and [0, 1] to [-0.5, 0.5]: mean 0, so A = c / (std(c) + eps)
    r2 = torch.tensor([1.0, 2, 6, 0, 1], dtype=F64)
    c2 = torch.tensor([-2.0, -1, 3, -0.5, 0.5], dtype=F64)
    torch.testing.assert_close(group_advantages(r2, [3, 2], estimator="reinforce_plus_plus_baseline"),
                               (c2 - c2.mean()) / (c2.std() + 1e-4), rtol=0, atol=1e-12)


def test_reinforce_plus_plus_baseline_subtracts_the_batch_mean():
    # one valid reward dropped from a group of 3: centred [-1.5, 1.5] and [-1, 0, 1], batch mean 0;
    # shifting one group's rewards changes nothing (each is centred by its own mean first)
    r = torch.tensor([1.0, 4, NAN, 0, 1, 2], dtype=F64)
    a = group_advantages(r, 3, estimator="reinforce_plus_plus_baseline")
    b = group_advantages(r + torch.tensor([0, 0, 0, 10, 10, 10], dtype=F64), 3,
                         estimator="reinforce_plus_plus_baseline")
    torch.testing.assert_close(a, b)
    valid = a[[0, 1, 3, 4, 5]]
    assert valid.mean().item() == pytest.approx(0.0, abs=1e-12)
    assert valid.std().item() == pytest.approx(1.0, abs=1e-3)  # whitened (up to eps)


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="grpo, rloo, reinforce_plus_plus_baseline"):
        group_advantages(torch.zeros(4), 2, estimator="ppo")


def _trl_rloo_advantages(rewards: torch.Tensor, num_generations: int) -> torch.Tensor:
    """Run RLOOTrainer._generate_and_score_completions (TRL 1.16, normalize_advantages=False) on a
    stand-in trainer: generation and log-probs are faked, the one reward function returns `rewards`."""
    from trl import RLOOTrainer

    n = rewards.numel()
    metrics = defaultdict(lambda: defaultdict(list))
    stub = SimpleNamespace(
        accelerator=SimpleNamespace(device="cpu", process_index=0), pad_to_multiple_of=None,
        model=SimpleNamespace(training=True, is_gradient_checkpointing=False), mask_truncated_completions=False,
        beta=0.0, _tokenizer=SimpleNamespace(pad_token_id=0), reward_clip_range=None, normalize_advantages=False,
        args=SimpleNamespace(per_device_train_batch_size=n, gradient_checkpointing_kwargs=None),
        _generate=lambda prompts: ([[1]] * n, [[2, 3]] * n, ["c"] * n),
        _get_per_token_logps_and_entropies=lambda *a, **k: (torch.zeros(n, 2, dtype=rewards.dtype), None, None),
        _calculate_rewards=lambda *a: rewards.unsqueeze(1).clone(),  # (N, 1)
        num_generations=num_generations, reward_weights=torch.ones(1, dtype=rewards.dtype), reward_func_names=["r"],
        _metrics=metrics, _pending_extra_logs={}, _pending_metrics={}, log_multimodal=False,
        _logs={"prompt": [], "completion": [], "advantages": [], "rewards": defaultdict(list),
               "extra": defaultdict(list)},
    )
    return RLOOTrainer._generate_and_score_completions(stub, [{"prompt": "p"}] * n)["advantages"]


def test_rloo_matches_trl():
    pytest.importorskip("trl")
    g = torch.Generator().manual_seed(1)
    rewards = torch.randn(24, generator=g, dtype=F64)  # 6 groups of 4
    rewards[4:8] = 0.5  # a zero-spread group
    rewards[[1, 9, 10]] = NAN  # unscorable rows, two in one group
    rewards[13:16] = NAN  # a group with one valid reward
    ours = group_advantages(rewards, 4, estimator="rloo")
    theirs = _trl_rloo_advantages(rewards, 4)
    torch.testing.assert_close(ours, theirs.to(F64), rtol=0, atol=1e-12)
    assert (ours != 0).sum() >= 12  # the comparison is not vacuous
