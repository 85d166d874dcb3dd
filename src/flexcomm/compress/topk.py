"""Exact top-k selection by magnitude, fast on large CPU gradients.

``torch.topk`` over 25M elements costs ~40x one memory pass on one CPU thread.  The
selection here stays exact (the same index set as ``torch.topk(x.abs(), k)``, ties
aside) but reads the gradient once, in cache-sized blocks:

1. read a strided sample of ``|x|`` and pick a threshold ``t`` that slightly more than
   ``k`` elements should pass (3 sigma of the sample's binomial noise on top of k);
2. walk ``x`` in blocks of ``BLOCK`` elements; per block, ``|x|`` goes into a small
   preallocated buffer, is compared to ``t`` into a small bool mask, and the survivors'
   positions and magnitudes are compacted.  The block stays in L2 between these steps,
   so main memory sees one read of ``x`` instead of the four passes (abs write, abs
   read, mask write, mask read) of whole-array steps; numpy's vectorised kernels are
   ~3x faster than torch's for the compare and the compaction on CPU;
3. an exact selection among the few candidates: numpy's in-place introselect
   (``ndarray.partition``: linear time, ~10x faster than ``torch.topk``) finds the k-th
   largest candidate magnitude, and one compare keeps the candidates above it (plus
   as many as needed of those equal to it).

If fewer than ``k`` elements pass (a sample that misjudged the tail), the answer would
not be exact, so a full exact selection runs instead.  Every element ``>= t`` is a
candidate and ``t`` is at most the k-th largest value whenever ``>= k`` pass, so the
candidates contain the true top-k.
"""

from __future__ import annotations

import math

import numpy as np
import torch

# Below this size the full selection is already cheap and the sampled pass doesn't pay off.
_FAST_PATH_MIN_NUMEL = 1 << 16
# The threshold sample: _SAMPLE_SIZE positions at a constant stride.  Each sampled
# position is a cache line read from main memory, so a large sample costs a good share
# of a pass (measured at 6.25M float32: 65K positions of g and e 0.5 copies of the
# bucket, 16K ~0.13); 16K positions put ~1.25 k candidates through at density 0.01
# (65K: ~1.12 k), which the candidate compaction and the final introselect barely feel.
_SAMPLE_SIZE = 1 << 14
# Elements per block of the candidate pass: the block of x, its magnitudes and its mask
# (~1.1 MB in float32) stay in a 2 MB L2.  Measured at 25M float32 on one thread: 64K
# and 256K are within ~5%; 16K-32K (Python overhead per block) and 512K (L2 spill) are
# 10-30% slower.
BLOCK = 1 << 17
# numpy has no bfloat16; such tensors use torch.topk.
_NUMPY_DTYPES = {torch.float32: np.float32, torch.float64: np.float64, torch.float16: np.float16}


def k_for(numel: int, density: float) -> int:
    """Number of elements kept: ``max(1, ceil(density * numel))``, at most ``numel``."""
    return min(numel, max(1, math.ceil(density * numel)))


class TopkWorkspace:
    """Preallocated buffers for :func:`topk_indices`, reused across steps.

    The candidate pass works block by block, so the block buffers are one block long (at
    most), not one gradient long.  The candidate buffers grow to the largest candidate
    count seen (~1.2 k).  Fresh multi-MB allocations page-fault at ~3 GB/s on CPU, as
    slow as the passes themselves, so they live as long as the bucket.
    """

    def __init__(self) -> None:
        self._abs: np.ndarray | None = None
        self._mask: np.ndarray | None = None
        self._positions: np.ndarray = np.empty(0, dtype=np.int32)
        self._magnitudes: np.ndarray = np.empty(0, dtype=np.float32)
        self._scratch: np.ndarray = np.empty(0, dtype=np.float32)
        self._keep: np.ndarray = np.empty(0, dtype=np.bool_)

    def buffers(self, numel: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray]:
        """A magnitude buffer and a bool mask for blocks of up to ``min(numel, BLOCK)`` elements."""
        size = min(numel, BLOCK)
        if self._abs is None or self._abs.shape[0] != size or self._abs.dtype != dtype:
            self._abs = np.empty(size, dtype=dtype)
            self._mask = np.empty(size, dtype=np.bool_)
        assert self._mask is not None
        return self._abs, self._mask

    def candidate_buffers(self, count: int, dtype: np.dtype) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Views of ``count`` elements: int32 positions, magnitudes, scratch magnitudes, bool keep-mask."""
        if self._positions.shape[0] < count or self._magnitudes.dtype != dtype:
            capacity = count + count // 4
            self._positions = np.empty(capacity, dtype=np.int32)
            self._magnitudes = np.empty(capacity, dtype=dtype)
            self._scratch = np.empty(capacity, dtype=dtype)
            self._keep = np.empty(capacity, dtype=np.bool_)
        return self._positions[:count], self._magnitudes[:count], self._scratch[:count], self._keep[:count]


def topk_indices(x: torch.Tensor, k: int, workspace: TopkWorkspace | None = None) -> torch.Tensor:
    """Indices (int32) of the ``k`` largest ``|x|`` of a flat tensor, in no particular order."""
    if x.dim() != 1:
        raise ValueError(f"topk_indices expects a flat tensor, got shape {tuple(x.shape)}")
    if not 1 <= k <= x.numel():
        raise ValueError(f"k must be in [1, {x.numel()}], got {k}")
    if fast_path_applies(x, k):
        found = _candidate_topk(x, k, workspace or TopkWorkspace())
        if found is not None:
            return found
    return full_topk(x, k)


def fast_path_applies(x: torch.Tensor, k: int) -> bool:
    """Whether the sampled-threshold candidate pass serves ``x``: a large CPU tensor numpy can read, k a small share of it."""
    return (
        x.device.type == "cpu"
        and x.dtype in _NUMPY_DTYPES
        and x.numel() >= _FAST_PATH_MIN_NUMEL
        and k * 4 <= x.numel()
    )


def full_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Exact top-k over all of ``x``: numpy's introselect where it can (~5x faster than
    ``torch.topk`` at 25M on one thread), ``torch.topk`` for other dtypes and devices."""
    if x.device.type == "cpu" and x.dtype in _NUMPY_DTYPES:
        return torch.from_numpy(_largest(np.abs(x.detach().numpy()), k).astype(np.int32))
    return torch.topk(x.abs(), k, sorted=False).indices.to(torch.int32)


def _largest(magnitude: np.ndarray, k: int) -> np.ndarray:
    """Positions of the ``k`` largest entries of ``magnitude`` (NaN counts as largest, as in torch.topk)."""
    n = magnitude.shape[0]
    if k == n:
        return np.arange(n)
    return np.argpartition(magnitude, n - k)[n - k :]


def _candidate_topk(x: torch.Tensor, k: int, workspace: TopkWorkspace) -> torch.Tensor | None:
    xn = x.detach().numpy()
    threshold = sampled_threshold(np.abs(xn[:: sample_stride(xn.shape[0])]), xn.shape[0], k)
    if not math.isfinite(threshold):
        return None
    candidates = CandidatePass(workspace, xn.shape[0], xn.dtype, threshold)
    for start in range(0, xn.shape[0], BLOCK):
        candidates.add(xn[start : start + BLOCK], start)
    return candidates.top(k)


class CandidatePass:
    """Step 2 of the module's selection, fed one block at a time; :meth:`top` is step 3.

    Every element whose magnitude is at least ``threshold`` becomes a candidate.  The
    caller walks its tensor in blocks of at most :data:`BLOCK` elements, so that a caller
    that computes the block first (:mod:`flexcomm.compress.fused`) selects it while it is
    still in cache.
    """

    def __init__(self, workspace: TopkWorkspace, numel: int, dtype: np.dtype, threshold: float) -> None:
        self._workspace = workspace
        self._magnitude, self._passes = workspace.buffers(numel, dtype)
        self._threshold = self._magnitude.dtype.type(threshold)
        self._positions: list[np.ndarray] = []
        self._magnitudes: list[np.ndarray] = []
        self._count = 0

    def add(self, block: np.ndarray, start: int) -> None:
        """Keep the candidates of ``block``, the elements ``start .. start + len(block)`` of the tensor."""
        size = block.shape[0]
        mag, mask = self._magnitude[:size], self._passes[:size]
        np.abs(block, out=mag)
        np.greater_equal(mag, self._threshold, out=mask)
        hits = np.flatnonzero(mask)
        self._magnitudes.append(mag[hits])
        hits += start
        self._positions.append(hits)
        self._count += hits.shape[0]

    def top(self, k: int) -> torch.Tensor | None:
        """The exact top-k among the candidates (int32 indices), or None if fewer than ``k`` passed."""
        count = self._count
        if count < k:
            return None
        positions, magnitudes, scratch, keep = self._workspace.candidate_buffers(count, self._magnitude.dtype)
        np.concatenate(self._positions, out=positions, casting="unsafe")
        np.concatenate(self._magnitudes, out=magnitudes)
        if count == k:
            return torch.from_numpy(positions.copy())
        # The k-th largest candidate magnitude, by an in-place introselect on a copy (no
        # allocation, ~2x faster than argpartition plus the gathers it needs).
        np.copyto(scratch, magnitudes)
        scratch.partition(count - k)
        kth = scratch[count - k]
        np.greater(magnitudes, kth, out=keep)
        chosen = positions[keep]
        if chosen.shape[0] < k:
            # Ties at the k-th magnitude: fill up with the first of them.
            tied = positions[magnitudes == kth][: k - chosen.shape[0]]
            chosen = np.concatenate([chosen, tied])
        return torch.from_numpy(chosen)


def sample_stride(numel: int) -> int:
    """The stride of the threshold's sample of a ``numel``-element tensor."""
    return max(1, numel // _SAMPLE_SIZE)


def sampled_threshold(sample: np.ndarray, numel: int, k: int) -> float:
    """A magnitude that about ``k`` (plus a 3-sigma margin) of ``numel`` elements exceed, from ``sample`` (magnitudes at :func:`sample_stride`)."""
    m = sample.shape[0]
    expected = m * k / numel
    keep = min(m, math.ceil(expected + 3.0 * math.sqrt(expected) + 1.0))
    top = np.partition(sample, m - keep)[m - keep :]
    # NaN sorts last (largest); a sampled NaN means a NaN gradient, which torch.topk
    # would select: leave that to the full selection, as a non-finite threshold.
    if np.isnan(top).any():
        return math.nan
    return float(top[0])
