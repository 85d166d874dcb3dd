"""Compression gain ``||C_c(a)||_2 / ||a||_2`` for many densities from one selection.

Top-k keeps the k largest magnitudes, so ``||C_c(a)||^2`` is the sum of the k_c largest
``a_j^2``: one top-k at the largest density below 1, sorted, and a prefix sum of squares
give the gain of every candidate density at once, instead of compressing at each.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flexcomm.compress.topk import TopkWorkspace, k_for, topk_indices


def energy_curve(a: torch.Tensor, densities: Sequence[float], workspace: TopkWorkspace | None = None) -> torch.Tensor:
    """``||C_c(a)||_2^2`` (top-k by magnitude) for each density c, then ``||a||_2^2``: one fp64 tensor on
    ``a``'s device, read by no one here (it is summed over buckets and allreduced as it is: no host sync).

    Squared norms add over buckets, so a model's gain is ``sqrt(sum kept / sum total)``.
    """
    numel = a.numel()
    ks = [k_for(numel, c) for c in densities]
    total = torch.linalg.vector_norm(a, dtype=torch.float64).square()
    sparse_ks = [k for k in ks if k < numel]
    if not sparse_ks:
        return torch.stack([total] * (len(ks) + 1))
    top = a.index_select(0, topk_indices(a, max(sparse_ks), workspace)).abs().double()
    prefix = torch.cumsum(torch.sort(top, descending=True).values.square(), 0)
    # Keeping everything keeps all the energy: no need to sort the whole tensor for it.
    return torch.stack([prefix[k - 1] if k < numel else total for k in ks] + [total])
