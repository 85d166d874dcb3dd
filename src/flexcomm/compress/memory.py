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

The fused path (:meth:`ResidualMemory.accumulate`, :meth:`ResidualMemory.commit`) costs
one pass for ``a = g + e`` and none for the new residual: each bucket has two buffers,
the residual ``e`` and a spare.  ``a`` is written into the spare (``g``'s buffer stays
free for the exchanged update), the sent positions of the spare are zeroed (k writes),
and the spare becomes the residual -- unless the exchange turned out non-finite, in which
case the old residual stays.  That condition is a device tensor: the swap waits until
:meth:`ResidualMemory.settle` reads every pending condition in one transfer, once per
step, so no exchange stalls on a host read.

Residuals of half-precision gradients (fp16, bf16) are kept in fp32: a residual holds
many steps' worth of small values, which a 16-bit mantissa would round away (what was
not sent would be lost after all).  For such buckets ``a = g + e`` is fp32 too; the
exchanges send its selected values in the gradient's dtype.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import torch

log = logging.getLogger(__name__)

Layout = tuple[tuple[str, int], ...]

_HALF = (torch.float16, torch.bfloat16)


def residual_dtype(grad_dtype: torch.dtype) -> torch.dtype:
    """The dtype residuals (and ``a = g + e``) of a ``grad_dtype`` bucket are kept in: fp32 for fp16/bf16."""
    return torch.float32 if grad_dtype in _HALF else grad_dtype


class ResidualMemory:
    """Per-bucket error-feedback residuals.

    Args:
        named: whether layout keys are unique parameter names (enables migration).
    """

    def __init__(self, named: bool = False) -> None:
        self.named = named
        self._residuals: dict[int, torch.Tensor] = {}
        self._layouts: dict[int, Layout] = {}
        # The second buffer of each bucket (the fused path writes a = g + e into it).
        self._spares: dict[int, torch.Tensor] = {}
        # Buckets whose spare holds a new residual, with the device condition to adopt it.
        self._pending: dict[int, tuple[Layout, torch.Tensor]] = {}
        self._lock = threading.Lock()  # commits arrive on the backend's threads
        # Residual pieces of parameters whose new bucket has not come by yet (named only).
        self._pieces: dict[str, torch.Tensor] = {}

    def compensate(self, bucket_index: int, layout: Layout, grad: torch.Tensor) -> torch.Tensor:
        """Add the bucket's residual to ``grad`` in place and return it: ``a = g + e``."""
        residual = self._current(bucket_index, layout, grad)
        return grad if residual is None else grad.add_(residual)

    def accumulate(self, bucket_index: int, layout: Layout, grad: torch.Tensor) -> torch.Tensor:
        """``a = g + e`` written into the bucket's spare buffer (one pass); ``grad`` is left as it was.

        Follow with :meth:`commit` once the sent indices are known.
        """
        residual = self._current(bucket_index, layout, grad)
        dtype = residual_dtype(grad.dtype)
        spare = self._spares.get(bucket_index)
        if spare is None or spare.shape != grad.shape or spare.dtype != dtype or spare.device != grad.device:
            spare = self._spares[bucket_index] = torch.empty_like(grad, dtype=dtype)
        return spare.copy_(grad) if residual is None else torch.add(grad, residual, out=spare)

    def commit(self, bucket_index: int, layout: Layout, sent: torch.Tensor, adopt_if: torch.Tensor) -> None:
        """Zero the ``sent`` indices of :meth:`accumulate`'s ``a``: it becomes the residual if ``adopt_if`` holds.

        ``adopt_if`` is a 0-d bool tensor (the exchange was finite); it is read by :meth:`settle`.
        """
        self._spares[bucket_index].index_fill_(0, sent.long(), 0)
        with self._lock:
            self._pending[bucket_index] = (layout, adopt_if)

    def forget_if(self, bucket_index: int, condition: torch.Tensor) -> None:
        """Drop the residual at :meth:`settle` if ``condition`` (0-d bool) holds: a dense exchange sent it."""
        with self._lock:
            self._pending[bucket_index] = ((), condition)

    def pending(self) -> dict[int, torch.Tensor]:
        """The device conditions :meth:`settle` needs, per bucket."""
        with self._lock:
            return {index: condition for index, (_, condition) in self._pending.items()}

    def settle(self, conditions: dict[int, bool] | None = None) -> None:
        """Apply pending commits: ``conditions`` are :meth:`pending`'s values read on the host (read here if None)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        conditions = dict(conditions or {})
        unread = [i for i in pending if i not in conditions]
        if unread:
            values = torch.stack([pending[i][1].to(torch.bool).cpu() for i in unread]).tolist()
            conditions.update(zip(unread, values))
        for index, (layout, _) in pending.items():
            if not conditions[index]:
                continue
            if not layout:  # forget_if
                self.forget(index)
                continue
            old = self._residuals.get(index)
            self._residuals[index], self._layouts[index] = self._spares.pop(index), layout
            if old is not None:
                self._spares[index] = old

    def _current(self, bucket_index: int, layout: Layout, grad: torch.Tensor) -> torch.Tensor | None:
        """The residual to add to ``grad``, after a layout change (cut or dropped) and a restore (moved)."""
        if bucket_index in self._pending:
            self.settle()  # normally settled already, once per step, by the caller
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
        dtype = residual_dtype(grad.dtype)
        if residual is not None and (residual.device != grad.device or residual.dtype != dtype):
            # Restored from a (CPU) checkpoint onto an accelerator: move it once.
            residual = self._residuals[bucket_index] = residual.to(grad.device, dtype)
        return residual

    def update(self, bucket_index: int, layout: Layout, accumulated: torch.Tensor, sent: torch.Tensor) -> None:
        """Residual := ``accumulated`` with the ``sent`` indices zeroed (a copy; :meth:`commit` is the fused way)."""
        self.settle()
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
        self._spares.pop(bucket_index, None)

    def layout(self, bucket_index: int) -> Layout | None:
        """The parameters (key, numel) of the bucket's residual, in buffer order."""
        self.settle()
        return self._layouts.get(bucket_index)

    def holds(self, bucket_index: int) -> bool:
        """Whether the bucket has a residual (or a pending one)."""
        return bucket_index in self._residuals or bucket_index in self._pending

    def residual(self, bucket_index: int) -> torch.Tensor | None:
        """The bucket's residual now (pending commits settled first)."""
        self.settle()
        return self._residuals.get(bucket_index)

    def _cut_all_into_pieces(self) -> None:
        # A rebuild moves every bucket at once: cut them all before any is re-assembled.
        self.settle()
        for index in list(self._residuals):
            self._pieces.update(_cut(self._residuals[index], self._layouts[index]))
            self.forget(index)

    def _assemble(self, bucket_index: int, layout: Layout, grad: torch.Tensor) -> torch.Tensor | None:
        if not any(key in self._pieces for key, _ in layout):
            return None
        parts = [self._pieces.pop(key, None) for key, _ in layout]
        dtype = residual_dtype(grad.dtype)
        residual = torch.cat([
            part.to(grad.device, dtype) if part is not None else grad.new_zeros(numel, dtype=dtype)
            for part, (_, numel) in zip(parts, layout)
        ])
        self._residuals[bucket_index] = residual
        self._layouts[bucket_index] = layout
        return residual

    def state_dict(self) -> dict[str, Any]:
        """Named: one residual per parameter (valid under any bucket layout); else per bucket."""
        self.settle()
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
        self._residuals, self._layouts, self._spares, self._pending = {}, {}, {}, {}
        if self.named:
            self._pieces = {key: piece.clone() for key, piece in state["pieces"].items()}
        else:
            self._pieces = {}
            self._residuals = {int(i): r.clone() for i, r in state["residuals"].items()}
            self._layouts = {int(i): tuple((str(k), int(n)) for k, n in lay) for i, lay in state["layouts"].items()}


def _cut(residual: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    return dict(zip((key for key, _ in layout), residual.split([numel for _, numel in layout])))
