"""Per-bucket statistics of the error-corrected gradient ``a``, kept on ``a``'s device.

Nothing here reads a tensor back to the host: on an accelerator every such read stalls
the stream, once per bucket.  The statistics stay 0-d tensors until the step's records
are settled, and :func:`to_host` then reads all of them in one transfer.

``||a||_2`` serves three purposes: the compression gain ``||sent|| / ||a||`` a record
reports, VAR-Topk's leader statistic, and the finiteness check.  It is accumulated in
fp32 (one read pass, or a by-product of the accumulation pass,
:mod:`flexcomm.compress.fused`); a NaN or Inf anywhere in ``a`` makes it non-finite.  So does a norm
beyond fp32's range (elements above ~1e19): such an ``a`` is treated as an overflow,
the way ``torch.amp.GradScaler`` treats one.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def norm_and_finiteness(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``||a||_2`` (a 0-d fp32 tensor, fp64 for fp64 ``a``) and whether it is finite (0-d bool), one pass."""
    accumulate = torch.float64 if a.dtype == torch.float64 else torch.float32
    norm = torch.linalg.vector_norm(a, dtype=accumulate)
    return norm, torch.isfinite(norm)


def contributed_values(a: torch.Tensor, indices: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``a[indices]``, all NaN unless ``finite`` (a 0-d bool tensor): see :func:`nan_unless`."""
    return nan_unless(a.index_select(0, indices), finite)


def nan_unless(values: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """``values`` in place, all NaN unless ``finite`` (a 0-d bool tensor), without a host read.

    A non-finite ``a_i`` on one rank makes the whole exchanged update non-finite on every
    rank, so that every rank sees it (GradScaler skips the step) and drops its residual.
    """
    nan = torch.full((), float("nan"), dtype=values.dtype, device=values.device)
    return values.add_(torch.where(finite, torch.zeros_like(nan), nan))


def gain(values: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``||values||_2 / norm`` as a 0-d tensor: 0 for an all-zero ``a``, NaN for a non-finite one."""
    sent = torch.linalg.vector_norm(values, dtype=norm.dtype)
    return torch.where(norm == 0, torch.zeros_like(norm), sent / norm)


def variance(a: torch.Tensor) -> torch.Tensor:
    """The population variance of ``a`` (0 for an empty tensor), as a 0-d fp32 tensor."""
    if a.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=a.device)
    return a.var(correction=0).float()


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """Whether every element of ``t`` is finite, as a 0-d bool tensor.

    One read pass: NaN propagates to both the minimum and the maximum, -Inf and +Inf
    show in one of them.  (``isfinite(t).all()`` writes a bool buffer of ``t``'s size
    first and is ~30x slower on CPU.)
    """
    if t.numel() == 0:
        return torch.ones((), dtype=torch.bool, device=t.device)
    low, high = torch.aminmax(t)
    return torch.isfinite(low) & torch.isfinite(high)


def to_host(tensors: Sequence[torch.Tensor]) -> list[list[float]]:
    """The values of many small tensors, read in one device-to-host transfer (fp64)."""
    if not tensors:
        return []
    flat = [t.detach().reshape(-1).to(torch.float64) for t in tensors]
    values = torch.cat([f.to(flat[0].device) for f in flat]).tolist()
    out, start = [], 0
    for f in flat:
        out.append(values[start : start + f.numel()])
        start += f.numel()
    return out


#: Coordinates of a bucket on which an update's agreement with the mean gradient is measured.
QUALITY_SAMPLE = 1024


def sample_size(numel: int) -> int:
    """How many positions of a ``numel``-element bucket :func:`sample_positions` takes."""
    return min(QUALITY_SAMPLE, numel)


def sample_positions(numel: int, step: int) -> slice:
    """A strided sample of :func:`sample_size` positions of a bucket, the same on every rank, moving with ``step``."""
    stride = max(1, numel // QUALITY_SAMPLE)
    start = step % stride
    return slice(start, start + stride * sample_size(numel), stride)


def sampled(grad: torch.Tensor, step: int, world_size: int) -> tuple[slice, torch.Tensor]:
    """The bucket's sample positions at ``step`` and ``g / N`` there, in fp32 (a copy: the accumulation pass zeroes ``grad``)."""
    positions = sample_positions(grad.numel(), step)
    return positions, grad[positions].to(torch.float32, copy=True).div_(world_size)


def cosine(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``<u, v> / (||u|| ||v||)`` in fp32 as a 0-d tensor: 0 if either is all zero, NaN if either is not finite."""
    u, v = u.float(), v.float()
    norms = torch.linalg.vector_norm(u) * torch.linalg.vector_norm(v)
    return torch.where(norms == 0, torch.zeros_like(norms), (u * v).sum() / norms)
