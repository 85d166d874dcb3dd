"""Per-bucket statistics of the error-corrected gradient ``a``: norm, finiteness, gain.

``||a||_2`` serves three purposes: the compression gain ``||sent|| / ||a||`` a record
reports, VAR-Topk's leader statistic, and the finiteness check (a finite norm proves
every element finite; only an overflowing norm needs the element-wise check).
"""

from __future__ import annotations

import math

import torch


def norm_and_finiteness(a: torch.Tensor) -> tuple[float, bool]:
    """``||a||_2`` (accumulated in fp32) and whether ``a`` is all finite, in one pass."""
    norm = float(torch.linalg.vector_norm(a, dtype=torch.float32))
    finite = math.isfinite(norm) or bool(torch.isfinite(a).all())
    return norm, finite


def contributed_values(a: torch.Tensor, indices: torch.Tensor, finite: bool) -> torch.Tensor:
    """``a[indices]``; all NaN when ``a`` is not finite.

    A non-finite ``a_i`` on one rank makes the whole exchanged update non-finite on every
    rank, so that every rank sees it (GradScaler skips the step) and keeps its old residual.
    """
    values = a.index_select(0, indices)
    if not finite:
        values.fill_(float("nan"))
    return values


def gain(values: torch.Tensor, norm: float) -> float:
    """``||values||_2 / norm``: 0 for an all-zero ``a``, NaN for a non-finite one."""
    if norm == 0.0 or not math.isfinite(norm):
        return 0.0 if norm == 0.0 else float("nan")
    return float(torch.linalg.vector_norm(values, dtype=torch.float32)) / norm


def variance(a: torch.Tensor) -> float:
    """The population variance of ``a`` (0 for an empty tensor)."""
    return float(a.var(correction=0)) if a.numel() > 0 else 0.0
