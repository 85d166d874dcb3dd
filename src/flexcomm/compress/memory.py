"""Error-feedback memory: what a rank did not send is kept, not lost.

For every DDP bucket the memory holds a residual ``e``.  Before compression the bucket's
gradient ``g`` becomes the accumulated gradient ``a = g + e``; after the exchange the
residual becomes ``e = a`` with the sent positions zeroed, so that, per rank,

    (values contributed at the sent indices) + (new residual) == a     exactly.

A bucket's *layout* lists its parameters in buffer order as ``(key, numel)`` pairs.  DDP
rebuilds its buckets after the first iteration, and a restarted job starts again from
the initial layout, so a residual can outlive its bucket:

* with named layouts (keys are parameter names, see :func:`flexcomm.register`), residuals
  are cut into per-parameter pieces and re-assembled for whatever bucket holds those
  parameters next; checkpoints store them per parameter, so nothing is lost on a rebuild
  or a restart;
* with anonymous layouts (keys are shapes: the hook was registered without names), a
  residual whose layout no longer matches is dropped, as PyTorch's PowerSGD hook does,
  rather than added to the wrong parameters.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

Layout = tuple[tuple[str, int], ...]


class ResidualMemory:
    """Per-bucket error-feedback residuals.

    Args:
        named: whether layout keys are unique parameter names (enables migration).
    """

    def __init__(self, named: bool = False) -> None:
        self.named = named
        self._residuals: dict[int, torch.Tensor] = {}
        self._layouts: dict[int, Layout] = {}
        # Residual pieces of parameters whose new bucket has not come by yet (named only).
        self._pieces: dict[str, torch.Tensor] = {}

    def compensate(self, bucket_index: int, layout: Layout, grad: torch.Tensor) -> torch.Tensor:
        """Add the bucket's residual to ``grad`` in place and return it: ``a = g + e``."""
        residual = self._residuals.get(bucket_index)
        if residual is not None and (self._layouts[bucket_index] != layout or residual.shape != grad.shape):
            if self.named:
                self._cut_all_into_pieces()
            else:
                log.info("bucket %d changed layout; its error-feedback residual starts over", bucket_index)
                self.forget(bucket_index)
            residual = None
        if residual is None and self._pieces:
            residual = self._assemble(bucket_index, layout, grad)
        if residual is None:
            return grad
        if residual.device != grad.device:
            # Restored from a (CPU) checkpoint onto an accelerator: move it once.
            residual = self._residuals[bucket_index] = residual.to(grad.device)
        return grad.add_(residual.to(grad.dtype))

    def update(self, bucket_index: int, layout: Layout, accumulated: torch.Tensor, sent: torch.Tensor) -> None:
        """Residual := ``accumulated`` with the ``sent`` indices zeroed."""
        residual = self._residuals.get(bucket_index)
        if residual is None or residual.shape != accumulated.shape or residual.dtype != accumulated.dtype or residual.device != accumulated.device:
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

    def _cut_all_into_pieces(self) -> None:
        # A rebuild moves every bucket at once: cut them all before any is re-assembled.
        for index in list(self._residuals):
            self._pieces.update(_cut(self._residuals[index], self._layouts[index]))
            self.forget(index)

    def _assemble(self, bucket_index: int, layout: Layout, grad: torch.Tensor) -> torch.Tensor | None:
        if not any(key in self._pieces for key, _ in layout):
            return None
        parts = [self._pieces.pop(key, None) for key, _ in layout]
        residual = torch.cat([
            part.to(grad.device, grad.dtype) if part is not None else grad.new_zeros(numel)
            for part, (_, numel) in zip(parts, layout)
        ])
        self._residuals[bucket_index] = residual
        self._layouts[bucket_index] = layout
        return residual

    def state_dict(self) -> dict[str, Any]:
        """Named: one residual per parameter (valid under any bucket layout); else per bucket."""
        if self.named:
            pieces = {key: piece.detach().cpu().clone() for key, piece in self._pieces.items()}
            for index, residual in self._residuals.items():
                pieces.update({key: piece.detach().cpu().clone() for key, piece in _cut(residual, self._layouts[index]).items()})
            return {"named": True, "pieces": pieces}
        return {
            "named": False,
            "residuals": {i: r.detach().cpu().clone() for i, r in self._residuals.items()},
            "layouts": dict(self._layouts),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["named"] != self.named:
            raise ValueError(
                "checkpoint residuals are stored "
                + ("per parameter name" if state["named"] else "per anonymous bucket")
                + ", but this run's hook was registered "
                + ("with" if self.named else "without")
                + " parameter names (flexcomm.register)"
            )
        self._residuals, self._layouts = {}, {}
        if self.named:
            self._pieces = {key: piece.clone() for key, piece in state["pieces"].items()}
        else:
            self._pieces = {}
            self._residuals = {int(i): r.clone() for i, r in state["residuals"].items()}
            self._layouts = {int(i): tuple((str(k), int(n)) for k, n in lay) for i, lay in state["layouts"].items()}


def _cut(residual: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    return dict(zip((key for key, _ in layout), residual.split([numel for _, numel in layout])))
