"""Error feedback's accumulation in one pass: ``a = g + e`` in place, the bucket zeroed, ``||a||``, and the top-k.

A sparse exchange needs, from the bucket's gradient ``g`` and residual ``e``:

* ``a = g + e``, written over ``e`` itself: the residual's buffer holds ``a`` until the
  exchange zeroes the sent positions, and then it *is* the new residual (no second
  gradient-sized buffer, no copy);
* the bucket ``g`` zeroed, ready for the sparse update to be written into it;
* ``||a||_2`` (the compression gain's denominator and the finiteness check,
  :mod:`flexcomm.compress.stats`);
* on a rank that selects, the indices of the ``k`` largest ``|a|``.

Done op by op that is five reads or writes of M elements (add, zero, norm, selection's
read) plus the selection's own work.  On CPU, for float32/float64 buckets, this module
walks ``g`` and ``e`` together in blocks of :data:`~flexcomm.compress.topk.BLOCK`
elements: per block ``e += g``, ``g = 0``, the block's sum of squares and its top-k
candidates (:class:`~flexcomm.compress.topk.CandidatePass`) while the block is in cache,
so main memory sees ``g`` and ``e`` read once and written once.  The threshold comes
from a strided sample of ``|g + e|`` taken before the pass.  If fewer than ``k``
candidates pass it (the sample misjudged the tail), an exact selection reads ``a``
again; the answer is exact either way.

Elsewhere (accelerators, half-precision gradients with their fp32 residuals, small
buckets) the same results come from whole-tensor torch ops.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from flexcomm.compress.stats import norm_and_finiteness
from flexcomm.compress.topk import (BLOCK, CandidatePass, TopkWorkspace, fast_path_applies, full_topk, sample_stride,
                                    sampled_threshold, topk_indices)

_NUMPY_FLOATS = (torch.float32, torch.float64)


@dataclass(frozen=True)
class Accumulation:
    """What one accumulation pass produced.

    ``a``: ``g + e``, in the residual's buffer; ``norm``: ``||a||_2`` as a 0-d tensor on
    ``a``'s device (fp32, fp64 for fp64 ``a``); ``finite``: whether it is finite (0-d
    bool); ``indices``: the top-k of ``|a|`` (int32) when a selection was asked for.
    """

    a: torch.Tensor
    norm: torch.Tensor
    finite: torch.Tensor
    indices: torch.Tensor | None


def accumulate_in_place(residual: torch.Tensor, grad: torch.Tensor, k: int | None = None,
                        workspace: TopkWorkspace | None = None, fresh: bool = False) -> Accumulation:
    """``residual += grad``, ``grad`` zeroed, ``||residual||``, and its top-k indices if ``k`` is given.

    ``residual`` and ``grad`` are flat and of one size; ``residual`` may be wider (fp32 for
    a half-precision ``grad``).  ``fresh``: there is no residual yet, and ``residual`` is
    only a buffer to hold ``a = g`` (copied, its old contents never read).
    """
    if residual.shape != grad.shape:
        raise ValueError(f"residual {tuple(residual.shape)} and gradient {tuple(grad.shape)} differ in shape")
    workspace = workspace or TopkWorkspace()
    if _blocked_pass_applies(residual, grad):
        return _blocked(residual, grad, k, workspace, fresh)
    if fresh:
        residual.copy_(grad)
    else:
        residual.add_(grad)
    grad.zero_()
    norm, finite = norm_and_finiteness(residual)
    indices = topk_indices(residual, k, workspace) if k is not None else None
    return Accumulation(residual, norm, finite, indices)


def _blocked_pass_applies(residual: torch.Tensor, grad: torch.Tensor) -> bool:
    return (
        residual.device.type == "cpu"
        and grad.device.type == "cpu"
        and residual.dtype == grad.dtype
        and grad.dtype in _NUMPY_FLOATS
        and residual.is_contiguous()
        and grad.is_contiguous()
    )


def _blocked(residual: torch.Tensor, grad: torch.Tensor, k: int | None, workspace: TopkWorkspace, fresh: bool) -> Accumulation:
    e, g = residual.detach().numpy(), grad.detach().numpy()
    n = e.shape[0]
    candidates = None
    if k is not None and fast_path_applies(residual, k):
        stride = sample_stride(n)
        sample = g[::stride] if fresh else g[::stride] + e[::stride]
        threshold = sampled_threshold(np.abs(sample), n, k)
        if math.isfinite(threshold):
            candidates = CandidatePass(workspace, n, e.dtype, threshold)
    sum_of_squares = 0.0
    for start in range(0, n, BLOCK):
        e_block, g_block = e[start : start + BLOCK], g[start : start + BLOCK]
        if fresh:
            np.copyto(e_block, g_block)
        else:
            np.add(e_block, g_block, out=e_block)
        g_block.fill(0)
        sum_of_squares += float(np.dot(e_block, e_block))
        if candidates is not None:
            candidates.add(e_block, start)
    indices = None
    if k is not None:
        indices = candidates.top(k) if candidates is not None else None
        if indices is None:
            # topk_indices would take the same sample of the same a and fail the same way
            # (or skip its candidate pass, as this pass did): go to the exact selection.
            indices = full_topk(residual, k)
    norm = torch.tensor(math.sqrt(sum_of_squares), dtype=residual.dtype)
    return Accumulation(residual, norm, torch.isfinite(norm), indices)
