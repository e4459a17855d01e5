"""pass@k (unbiased estimator, hand-worked and against its definition by enumeration), mean@k, bootstrap bounds."""
from __future__ import annotations

import itertools
import math

import pytest
import torch

from preftune.evaluation.stats import bootstrap_mean_bounds, is_binary, pass_and_mean_at_k, pass_at_k


def test_pass_at_k_hand_worked():
    assert pass_at_k(4, 0, 4) == 0.0 and pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # pass@1 = c/n
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2))  # 1 - 3/10 = 0.7


@pytest.mark.parametrize("n,c,k", [(6, 2, 3), (7, 3, 2), (5, 1, 4)])
def test_pass_at_k_is_the_chance_that_a_random_k_subset_has_a_correct_sample(n, c, k):
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    exact = sum(any(samples[i] for i in s) for s in subsets) / len(subsets)
    assert pass_at_k(n, c, k) == pytest.approx(exact)


def test_pass_and_mean_at_k_over_prompts_skip_unscored():
    correct = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [1.0, 1.0, float("nan")]])
    p, m = pass_and_mean_at_k(correct, 2)
    assert p == pytest.approx((pass_at_k(3, 1, 2) + 0.0 + 1.0) / 3)
    assert m == pytest.approx((1 / 3 + 0 + 1) / 3)
    assert is_binary(correct) and not is_binary(torch.tensor([0.5, 1.0])) and not is_binary(torch.tensor([float("nan")]))


def test_bootstrap_bounds_bracket_the_mean_and_are_seeded():
    diffs = torch.tensor([1.0, 0.0, 0.0, 1.0, -1.0, 1.0, 0.0, 1.0] * 10)  # mean 0.375
    lo, hi = bootstrap_mean_bounds(diffs, 0.95, 4000, seed=0)
    assert lo < 0.375 < hi and lo > 0.2 and hi < 0.55
    assert (lo, hi) == bootstrap_mean_bounds(diffs, 0.95, 4000, seed=0)
    lo90, _ = bootstrap_mean_bounds(diffs, 0.90, 4000, seed=0)
    assert lo90 > lo  # a lower confidence level gives a tighter bound
    se = diffs.std().item() / math.sqrt(len(diffs))
    assert lo == pytest.approx(0.375 - 1.645 * se, abs=0.03)  # close to the normal approximation
    assert bootstrap_mean_bounds(torch.tensor([0.0] * 5), 0.95, 100, 0) == (0.0, 0.0)
