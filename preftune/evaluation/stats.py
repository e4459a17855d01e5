"""Statistics of held-out results (pure functions): pass@k, mean@k, bootstrap bounds."""
from __future__ import annotations

import math

import torch


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k)
    (Chen et al. 2021, arXiv:2107.03374, Eq. 1). Needs k <= n."""
    if not 0 < k <= n or not 0 <= c <= n:
        raise ValueError(f"need 0 < k <= n and 0 <= c <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def is_binary(x: torch.Tensor) -> bool:
    """Every non-NaN value is 0 or 1 (and there is at least one)."""
    v = x[~x.isnan()]
    return v.numel() > 0 and bool(((v == 0) | (v == 1)).all())


def pass_and_mean_at_k(correct: torch.Tensor, k: int) -> tuple[float, float]:
    """correct: (n_prompts, n) 0/1 with NaN = not scored. Mean over prompts of pass@k and of the
    share correct (mean@k), each prompt counting only its scored samples (prompts with < k are
    skipped)."""
    passes, means = [], []
    for row in correct:
        v = row[~row.isnan()]
        if v.numel() >= k:
            passes.append(pass_at_k(v.numel(), int(v.sum()), k))
            means.append(v.mean().item())
    if not passes:
        return float("nan"), float("nan")
    return sum(passes) / len(passes), sum(means) / len(means)


def bootstrap_mean_bounds(diffs: torch.Tensor, confidence: float, samples: int,
                          seed: int) -> tuple[float, float]:
    """Percentile bootstrap of the mean of paired differences (n,): the one-sided lower and upper
    bounds at `confidence` (the (1 - c) and c quantiles of the resampled means). Resampling is
    seeded."""
    n = diffs.numel()
    if n == 0:
        return float("nan"), float("nan")
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, n, (samples, n), generator=g)  # (S, n)
    means = diffs.double()[idx].mean(1)  # (S,)
    lo, hi = torch.quantile(means,
                            torch.tensor([1 - confidence, confidence],
                                         dtype=torch.float64)).tolist()
    return lo, hi
