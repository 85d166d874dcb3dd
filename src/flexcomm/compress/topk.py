"""Exact top-k selection by magnitude, fast on large CPU gradients.

``torch.topk`` over 25M elements costs ~100x one memory pass on one CPU thread.  The
selection here stays exact (the same index set as ``torch.topk(x.abs(), k)``, ties
aside) but does its heavy work in a few streaming passes:

1. read a strided sample of ``|x|`` and pick a threshold ``t`` that slightly more than
   ``k`` elements should pass (3 sigma of the sample's binomial noise on top of k);
2. one pass computes ``|x|`` into a preallocated buffer, one compares it to ``t`` and
   one compacts the survivors' positions (numpy's vectorised kernels are ~3x faster
   than torch's for the compare and the compaction on CPU);
3. the exact ``torch.topk`` runs on the few candidates only.

If fewer than ``k`` elements pass (a sample that misjudged the tail), the answer would
not be exact, so the full ``torch.topk`` runs instead.  Every element ``>= t`` is a
candidate and ``t`` is at most the k-th largest value whenever ``>= k`` pass, so the
candidates contain the true top-k.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Below this size the full torch.topk is already cheap and the passes don't pay off.
_FAST_PATH_MIN_NUMEL = 1 << 16
_SAMPLE_SIZE = 1 << 16
# numpy has no bfloat16; such tensors use torch.topk.
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def k_for(numel: int, density: float) -> int:
    """Number of elements kept: ``max(1, ceil(density * numel))``, at most ``numel``."""
    return min(numel, max(1, math.ceil(density * numel)))


class TopkWorkspace:
    """Preallocated buffers for :func:`topk_indices`, reused across steps.

    Fresh 100 MB allocations page-fault at ~3 GB/s on CPU, several times slower than the
    passes themselves, so the hot path writes into buffers that live as long as the bucket.
    """

    def __init__(self) -> None:
        self._abs: np.ndarray | None = None
        self._mask: np.ndarray | None = None

    def buffers(self, numel: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        if self._abs is None or self._abs.shape[0] != numel or self._abs.dtype != dtype:
            self._abs = np.empty(numel, dtype=dtype)
            self._mask = np.empty(numel, dtype=np.bool_)
        assert self._mask is not None
        return self._abs, self._mask


def topk_indices(x: torch.Tensor, k: int, workspace: TopkWorkspace | None = None) -> torch.Tensor:
    """Indices (int32) of the ``k`` largest ``|x|`` of a flat tensor, in no particular order."""
    if x.dim() != 1:
        raise ValueError(f"topk_indices expects a flat tensor, got shape {tuple(x.shape)}")
    if not 1 <= k <= x.numel():
        raise ValueError(f"k must be in [1, {x.numel()}], got {k}")
    if _fast_path_applies(x, k):
        found = _candidate_topk(x, k, workspace or TopkWorkspace())
        if found is not None:
            return found
    return torch.topk(x.abs(), k, sorted=False).indices.to(torch.int32)


def _fast_path_applies(x: torch.Tensor, k: int) -> bool:
    # When k is a large share of x, nearly everything is a candidate: no gain.
    return (
        x.device.type == "cpu"
        and x.dtype in _NUMPY_DTYPES
        and x.numel() >= _FAST_PATH_MIN_NUMEL
        and k * 4 <= x.numel()
    )


def _candidate_topk(x: torch.Tensor, k: int, workspace: TopkWorkspace) -> torch.Tensor | None:
    threshold = _sampled_threshold(x, k)
    if not math.isfinite(threshold):
        return None
    xn = x.detach().numpy()
    magnitude, passes = workspace.buffers(xn.shape[0], xn.dtype)
    np.abs(xn, out=magnitude)
    np.greater_equal(magnitude, magnitude.dtype.type(threshold), out=passes)
    candidates = np.flatnonzero(passes)
    if candidates.shape[0] < k:
        return None
    chosen = torch.topk(torch.from_numpy(magnitude[candidates]), k, sorted=False).indices
    return torch.from_numpy(candidates)[chosen].to(torch.int32)


def _sampled_threshold(x: torch.Tensor, k: int) -> float:
    """A magnitude that about ``k`` (plus a 3-sigma margin) elements of ``x`` exceed."""
    stride = max(1, x.numel() // _SAMPLE_SIZE)
    sample = x[::stride].abs()
    expected = sample.numel() * k / x.numel()
    keep = min(sample.numel(), math.ceil(expected + 3.0 * math.sqrt(expected) + 1.0))
    return float(torch.topk(sample, keep, sorted=False).values.min())
