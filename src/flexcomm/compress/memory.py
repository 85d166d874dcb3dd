"""Error-feedback memory: what a rank did not send is kept, not lost.

For every DDP bucket the memory holds a residual ``e``.  Before compression the bucket's
gradient ``g`` becomes the accumulated gradient ``a = g + e``; after the exchange the
residual becomes ``e = a`` with the sent positions zeroed, so that, per rank,

    (values contributed at the sent indices) + (new residual) == a     exactly.

Residuals are keyed by DDP bucket index together with the bucket's layout (the shapes of
its parameters).  DDP rebuilds its buckets after the first iteration; a residual whose
layout no longer matches its bucket is dropped, as PyTorch's PowerSGD hook does, rather
than added to the wrong parameters.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

Layout = tuple[tuple[int, ...], ...]


class ResidualMemory:
    """Per-bucket error-feedback residuals."""

    def __init__(self) -> None:
        self._residuals: dict[int, torch.Tensor] = {}
        self._layouts: dict[int, Layout] = {}

    def compensate(self, bucket_index: int, layout: Layout, grad: torch.Tensor) -> torch.Tensor:
        """Add the bucket's residual to ``grad`` in place and return it: ``a = g + e``."""
        residual = self._residuals.get(bucket_index)
        if residual is None:
            return grad
        if self._layouts[bucket_index] != layout or residual.shape != grad.shape:
            log.info("bucket %d changed layout; its error-feedback residual starts over", bucket_index)
            self.forget(bucket_index)
            return grad
        return grad.add_(residual.to(grad.dtype))

    def update(self, bucket_index: int, layout: Layout, accumulated: torch.Tensor, sent: torch.Tensor) -> None:
        """Residual := ``accumulated`` with the ``sent`` indices zeroed."""
        residual = self._residuals.get(bucket_index)
        if residual is None or residual.shape != accumulated.shape or residual.dtype != accumulated.dtype:
            residual = torch.empty_like(accumulated)
            self._residuals[bucket_index] = residual
        self._layouts[bucket_index] = layout
        residual.copy_(accumulated)
        residual[sent.long()] = 0

    def forget(self, bucket_index: int) -> None:
        """Drop a bucket's residual (after a dense exchange sent everything)."""
        self._residuals.pop(bucket_index, None)
        self._layouts.pop(bucket_index, None)

    def residual(self, bucket_index: int) -> torch.Tensor | None:
        return self._residuals.get(bucket_index)

    def state_dict(self) -> dict[str, Any]:
        return {
            "residuals": {i: r.detach().cpu().clone() for i, r in self._residuals.items()},
            "layouts": dict(self._layouts),
        }

    def load_state_dict(self, state: dict[str, Any], device: torch.device | None = None) -> None:
        self._residuals = {int(i): r.to(device) if device else r.clone() for i, r in state["residuals"].items()}
        self._layouts = {int(i): tuple(tuple(s) for s in lay) for i, lay in state["layouts"].items()}
