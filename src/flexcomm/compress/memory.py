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

The in-place path (:meth:`ResidualMemory.accumulate`, :meth:`~ResidualMemory.take`,
:meth:`~ResidualMemory.commit`) keeps one buffer per bucket, the residual, and costs one
pass for ``a = g + e`` and none for the new residual: ``a`` is written over ``e`` (by
:mod:`flexcomm.compress.fused`, which also zeroes the bucket, takes ``||a||`` and, on a
selecting rank, the top-k in that same pass), and the sent values are gathered and zeroed
in place (k reads and writes).  If the exchanged update turns out
non-finite (``torch.amp.GradScaler`` then skips the step) the residual is dropped: it
already holds this step's gradient, which the skipped step must not apply later, and
maybe the NaN itself.  That condition is a device tensor: the drop waits until
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

from flexcomm.compress.fused import Accumulation, accumulate_in_place
from flexcomm.compress.topk import TopkWorkspace

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
        # The buffers of dropped residuals, kept for the bucket's next sparse step: a fresh
        # gradient-sized allocation page-faults (on CPU ~3 GB/s, as slow as the pass itself),
        # and flex's explorations would measure that instead of the exchange's local work.
        self._unused: dict[int, torch.Tensor] = {}
        # Buckets whose residual is dropped at settle if the device condition holds.
        self._pending: dict[int, torch.Tensor] = {}
        self._lock = threading.Lock()  # commits arrive on the backend's threads
        # Residual pieces of parameters whose new bucket has not come by yet (named only).
        self._pieces: dict[str, torch.Tensor] = {}

    def compensate(self, bucket_index: int, layout: Layout, grad: torch.Tensor) -> torch.Tensor:
        """Add the bucket's residual to ``grad`` in place and return it: ``a = g + e``."""
        residual = self._current(bucket_index, layout, grad)
        return grad if residual is None else grad.add_(residual)

    def accumulate(self, bucket_index: int, layout: Layout, grad: torch.Tensor, k: int | None = None,
                   workspace: TopkWorkspace | None = None) -> Accumulation:
        """``a = g + e`` over the residual's buffer, ``grad`` zeroed, ``||a||`` and, given ``k``, the top-k, in one pass.

        Follow with :meth:`take` once the sent indices are known, then :meth:`commit`.
        """
        residual = self._current(bucket_index, layout, grad)
        fresh = residual is None
        if residual is None:
            residual = self._buffer(bucket_index, grad)
            self._residuals[bucket_index], self._layouts[bucket_index] = residual, layout
        return accumulate_in_place(residual, grad, k, workspace, fresh=fresh)

    def reserve(self, bucket_index: int, grad: torch.Tensor) -> None:
        """Make sure :meth:`accumulate` finds a buffer for ``grad`` with its pages mapped (a one-time cost, paid here)."""
        if bucket_index in self._residuals or self._fits(self._unused.get(bucket_index), grad):
            return
        self._unused[bucket_index] = torch.zeros_like(grad, dtype=residual_dtype(grad.dtype))

    def _buffer(self, bucket_index: int, grad: torch.Tensor) -> torch.Tensor:
        """A residual buffer for ``grad``: the bucket's unused one if it fits, else a new one."""
        unused = self._unused.pop(bucket_index, None)
        return unused if self._fits(unused, grad) else torch.empty_like(grad, dtype=residual_dtype(grad.dtype))

    @staticmethod
    def _fits(buffer: torch.Tensor | None, grad: torch.Tensor) -> bool:
        return (buffer is not None and buffer.shape == grad.shape and buffer.dtype == residual_dtype(grad.dtype)
                and buffer.device == grad.device)

    def take(self, bucket_index: int, indices: torch.Tensor) -> torch.Tensor:
        """The values of :meth:`accumulate`'s ``a`` at ``indices``, zeroed there: what is sent leaves the residual.

        Gathering and zeroing the same positions back to back touches each of their cache
        lines once.  Follow with :meth:`commit` once the exchange's finiteness is known.
        """
        residual, positions = self._residuals[bucket_index], indices.long()
        values = residual.index_select(0, positions)
        residual.index_fill_(0, positions, 0)
        return values

    def commit(self, bucket_index: int, finite: torch.Tensor) -> None:
        """Keep :meth:`take`'s residual if ``finite`` (0-d bool: the exchanged update was finite) holds.

        :meth:`settle` reads ``finite`` and drops the residual if it does not hold.
        """
        self.forget_if(bucket_index, finite.logical_not())

    def forget_if(self, bucket_index: int, condition: torch.Tensor) -> None:
        """Drop the residual at :meth:`settle` if ``condition`` (0-d bool) holds."""
        with self._lock:
            self._pending[bucket_index] = condition

    def pending(self) -> dict[int, torch.Tensor]:
        """The device conditions :meth:`settle` needs, per bucket."""
        with self._lock:
            return dict(self._pending)

    def settle(self, conditions: dict[int, bool] | None = None) -> None:
        """Apply pending drops: ``conditions`` are :meth:`pending`'s values read on the host (read here if None)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        if not pending:
            return
        conditions = dict(conditions or {})
        unread = [i for i in pending if i not in conditions]
        if unread:
            values = torch.stack([pending[i].to(torch.bool).cpu() for i in unread]).tolist()
            conditions.update(zip(unread, values))
        for index in pending:
            if conditions[index]:
                self.forget(index)

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
        """Drop a bucket's residual (after a dense exchange sent everything); its buffer waits for reuse."""
        residual = self._residuals.pop(bucket_index, None)
        self._layouts.pop(bucket_index, None)
        if residual is not None:
            self._unused[bucket_index] = residual

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
        self._unused.clear()  # the buckets are rebuilt: old buffers fit no one reliably

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
        self._residuals, self._layouts, self._pending, self._unused = {}, {}, {}, {}
        if self.named:
            self._pieces = {key: piece.clone() for key, piece in state["pieces"].items()}
        else:
            self._pieces = {}
            self._residuals = {int(i): r.clone() for i, r in state["residuals"].items()}
            self._layouts = {int(i): tuple((str(k), int(n)) for k, n in lay) for i, lay in state["layouts"].items()}


def _cut(residual: torch.Tensor, layout: Layout) -> dict[str, torch.Tensor]:
    return dict(zip((key for key, _ in layout), residual.split([numel for _, numel in layout])))
