"""MSTopk: top-k by multi-round threshold estimation (Shi et al., MLSys 2021).

Instead of an exact top-k, MSTopk binary-searches a threshold on ``|a|`` between its
mean and its maximum.  Each round counts the elements above the trial threshold (one
full pass), so ``rounds`` rounds cost ``rounds`` passes: the costly baseline the
paper compares AR-Topk against.

After the search two thresholds bracket k: ``upper`` (at most k elements pass, the most
such seen) and ``lower`` (more than k pass, the fewest such seen).  Everything above
``upper`` is taken; the remaining ``k - count(upper)`` come from the band
``[lower, upper)`` in index order.  The result has exactly k elements whenever the band
holds enough of them; the band elements are not necessarily the largest, which is the
approximation MSTopk makes.
"""

from __future__ import annotations

import torch

DEFAULT_ROUNDS = 20


def mstopk_indices(x: torch.Tensor, k: int, rounds: int = DEFAULT_ROUNDS) -> torch.Tensor:
    """Indices (int32) of about ``k`` large-magnitude elements of a flat tensor."""
    if x.dim() != 1:
        raise ValueError(f"mstopk_indices expects a flat tensor, got shape {tuple(x.shape)}")
    if not 1 <= k <= x.numel():
        raise ValueError(f"k must be in [1, {x.numel()}], got {k}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    magnitude = x.abs()
    upper, lower = _search_thresholds(magnitude, k, rounds)
    above = torch.nonzero(magnitude >= upper).flatten()
    missing = k - above.numel()
    if missing <= 0:
        return above[:k].to(torch.int32)
    band = torch.nonzero((magnitude >= lower) & (magnitude < upper)).flatten()
    return torch.cat([above, band[:missing]]).to(torch.int32)


def _search_thresholds(magnitude: torch.Tensor, k: int, rounds: int) -> tuple[float, float]:
    mean = float(magnitude.mean())
    peak = float(magnitude.max())
    # One mask reused by every round: a fresh 25M-element mask per round would measure
    # page faults, not the threshold search the baseline stands for.
    mask = torch.empty_like(magnitude, dtype=torch.bool)

    def count_at_least(threshold: float) -> int:
        return int(torch.count_nonzero(torch.ge(magnitude, threshold, out=mask)))

    upper, upper_count = peak, count_at_least(peak)
    lower, lower_count = 0.0, magnitude.numel()
    low_ratio, high_ratio = 0.0, 1.0
    for _ in range(rounds):
        ratio = (low_ratio + high_ratio) / 2
        threshold = mean + ratio * (peak - mean)
        count = count_at_least(threshold)
        if count <= k:
            high_ratio = ratio
            if count >= upper_count:
                upper, upper_count = threshold, count
        else:
            low_ratio = ratio
            if count < lower_count:
                lower, lower_count = threshold, count
    return upper, lower
