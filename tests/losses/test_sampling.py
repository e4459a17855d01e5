"""The rollout engine's importance correction (losses/sampling.py): hand-worked weights for each
mode, NaN behaviour log-probs, and the weights' place in grpo_loss (before the KL term)."""
from __future__ import annotations

import math

import pytest
import torch

from preftune.losses import grpo_loss
from preftune.losses.sampling import importance_weights, mismatch_stats, turn_index, turn_mismatch

# two rows, three tokens; row 1's last token is padding
OLD = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -0.7, -9.0]], dtype=torch.float64)
MU = torch.tensor([[-1.5, -2.0, -0.25], [-0.3, -0.2, 4.0]], dtype=torch.float64)
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
# log pi_old - log mu, masked: [[0.5, 0, -0.25], [0, -0.5, 0]]


def test_token_truncate_clips_each_token_ratio():
    w = importance_weights(OLD, MU, MASK, mode="token_truncate", clip_max=1.5, clip_min=0.7)
    expect = [[1.5, 1.0, math.exp(-0.25)], [1.0, 0.7, 1.0]]  # e^0.5 = 1.65 -> 1.5; e^-0.5 = 0.61 -> 0.7
    assert w.shape == (2, 3) and torch.allclose(w, torch.tensor(expect, dtype=torch.float64))


def test_token_mask_zeroes_tokens_outside_the_bounds():
    w = importance_weights(OLD, MU, MASK, mode="token_mask", clip_max=1.5, clip_min=0.7)
    assert torch.allclose(w, torch.tensor([[0.0, 1.0, math.exp(-0.25)], [1.0, 0.0, 1.0]], dtype=torch.float64))


def test_sequence_modes_use_the_summed_log_ratio():
    # row 0: 0.5 + 0 - 0.25 = 0.25; row 1: -0.5 (the padding token's 13.0 does not count)
    rho = torch.tensor([[math.exp(0.25)], [math.exp(-0.5)]], dtype=torch.float64)
    assert torch.allclose(importance_weights(OLD, MU, MASK, mode="sequence_truncate", clip_max=None), rho)
    assert torch.allclose(importance_weights(OLD, MU, MASK, mode="sequence_truncate", clip_max=1.2),
                          rho.clamp(max=1.2))
    masked = importance_weights(OLD, MU, MASK, mode="sequence_mask", clip_min=0.7, clip_max=3.0)
    assert masked.tolist() == [[pytest.approx(math.exp(0.25))], [0.0]]


def test_nan_behaviour_logps_give_weight_one_and_are_left_out_of_the_metrics():
    mu = MU.clone()
    mu[0, 0] = float("nan")
    w = importance_weights(OLD, mu, MASK, mode="token_truncate", clip_max=None)
    assert w[0, 0] == 1.0
    stats = mismatch_stats(OLD, mu, MASK, w)
    assert stats["diff_count"] == 4  # 5 counted tokens, one without a behaviour log-prob
    assert stats["diff_max"] == pytest.approx(0.5) and stats["diff_sum"] == pytest.approx(0.75)
    assert stats["ratio_count"] == 5 and stats["ratio_min"] == pytest.approx(math.exp(-0.5))


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="token_truncate"):
        importance_weights(OLD, MU, MASK, mode="per_token")


def test_weights_scale_the_policy_term_and_not_the_kl_term():
    torch.manual_seed(0)
    logps = (torch.randn(2, 3, dtype=torch.float64) - 1).requires_grad_()
    ref = logps.detach() + 0.1 * torch.randn(2, 3, dtype=torch.float64)
    adv = torch.tensor([1.0, -0.5], dtype=torch.float64)
    w = torch.tensor([[2.0], [0.5]], dtype=torch.float64)

    def loss(weights, beta):
        return grpo_loss(logps, None, ref, adv, MASK, beta=beta, loss_type="dapo", importance_weights=weights)[0]

    policy_only = loss(None, 0.0)
    kl_only = loss(None, 0.1) - policy_only
    # on-policy, each token's term is -A (ratio 1): the weighted sum by hand
    by_hand = -(2.0 * 1.0 * 3 + 0.5 * -0.5 * 2) / 5
    assert loss(w, 0.0).item() == pytest.approx(by_hand)
    assert loss(w, 0.1).item() == pytest.approx(by_hand + kl_only.item())
    assert loss(torch.ones(2, 3, dtype=torch.float64), 0.1).item() == pytest.approx(loss(None, 0.1).item())


def test_a_token_the_trainers_filter_drops_keeps_weight_one():
    old = OLD.clone()
    old[1, 1] = float("-inf")  # at a top-p boundary the engine kept the token, the trainer did not
    w = importance_weights(old, MU, MASK, mode="sequence_mask", clip_min=0.7)
    assert w[1, 0] == 1.0  # row 1's only other difference is 0: the sequence is kept, not masked
    assert mismatch_stats(old, MU, MASK, w)["diff_count"] == 4


def test_turns_start_after_each_tool_turn():
    tool = torch.tensor([[1, 1, 0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    assert turn_index(tool).tolist() == [[0, 0, 0, 0, 1, 1, 1, 2], [0] * 8]
    # completion: the first turn (2 tokens), a tool turn (2), the second turn (2), a tool turn, the
    # third (1); the padding after row 1's 5 tokens is out
    old = torch.tensor([[-1.0, -2.0, 0.0, 0.0, -1.0, -1.0, 0.0, -3.0], [-1.0] * 8])
    mu = torch.tensor([[-1.5, -2.0, 9.0, 9.0, -1.25, -0.75, 9.0, -1.0], [-1.1] * 8])
    mask = tool * torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    got = turn_mismatch(old, mu, mask.float(), tool, turns=2)
    # turn 1: |0.5| + 0 (row 0) + 5 x 0.1 (row 1); turn 2 and on, together: 0.25 + 0.25 + 2
    want = torch.tensor([[0.5 + 0.5, 7.0], [2.5, 3.0]])
    torch.testing.assert_close(got, want)
