"""Agreement: small collectives after which every rank holds the same values.

Every decision flexcomm takes (which exchange, which density, which index source) must
be the same on every rank, or the ranks would issue collectives of different sizes or in
a different order: a hang or garbage, never a clear error.  Decisions are therefore
taken only from inputs every rank holds identically, and these functions produce them:

* :func:`agree_on_config` compares every rank's configuration fingerprint once, at the
  first bucket, and raises on every rank naming the difference;
* :func:`allreduce_floats` combines a list of floats element-wise over ranks (sum of gain
  energies, min or max of measured times) so that every rank gets the same list;
  :func:`allreduce_floats_async` issues the same allreduce and returns at once, so that a
  decision's inputs can travel while the step computes (issue it on the hook's dispatcher
  thread, and never wait for it inside a future's callback).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from flexcomm.comm.collectives import control_device


class PendingFloats:
    """An issued :func:`allreduce_floats_async`: :meth:`values` waits for it (once) and keeps the list."""

    def __init__(self, combined: torch.Tensor | None, work: dist.Work | None, values: list[float] | None = None) -> None:
        self._combined, self._work, self._values = combined, work, values

    @classmethod
    def completed(cls, values: Sequence[float]) -> PendingFloats:
        """An agreement whose result is already known (restored from a checkpoint)."""
        return cls(None, None, [float(v) for v in values])

    def values(self) -> list[float]:
        """The combined list, the same on every rank; waits for the collective the first time."""
        if self._values is None:
            assert self._work is not None and self._combined is not None
            self._work.wait()
            self._values = self._combined.tolist()
            self._combined = self._work = None
        return self._values


def allreduce_floats_async(values: Sequence[float] | torch.Tensor, group: dist.ProcessGroup | None,
                           op: dist.ReduceOp) -> PendingFloats:
    """Issue the element-wise ``op`` (SUM, MIN or MAX) of every rank's list, in fp64; read it later.

    ``values`` may be a 1-D tensor (of a device's values, not read on the host here); the caller gives it up.
    """
    device = control_device(group)
    combined = (values.to(device=device, dtype=torch.float64) if isinstance(values, torch.Tensor)
                else torch.tensor(list(values), dtype=torch.float64, device=device))
    work = dist.all_reduce(combined, op=op, group=group, async_op=True)
    return PendingFloats(combined, work)


def allreduce_floats(values: Sequence[float], group: dist.ProcessGroup | None, op: dist.ReduceOp) -> list[float]:
    """Element-wise ``op`` (SUM, MIN or MAX) of every rank's list, in fp64; the same list on all ranks."""
    return allreduce_floats_async(values, group, op).values()


def agree_on_config(fingerprint: dict[str, object], group: dist.ProcessGroup | None) -> None:
    """Raise on every rank, naming the differences, unless all ranks hold the same ``fingerprint``.

    Ranks configured differently would exchange messages of different sizes or in a
    different order: a hang or garbage, never a clear error.  One allgather at start-up
    turns that into a message.
    """
    gathered: list[dict[str, object] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, fingerprint, group=group)
    differing = sorted({key for fp in gathered for key in set(fp) | set(fingerprint) if fp.get(key) != fingerprint.get(key)})
    if differing:
        detail = "; ".join(f"{key}: " + ", ".join(f"rank {r}={fp.get(key)!r}" for r, fp in enumerate(gathered)) for key in differing)
        raise ValueError(f"flexcomm configuration differs across ranks: {detail}")
