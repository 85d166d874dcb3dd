"""Timing collectives so that every rank agrees on the result.

A rank's own clock says little about a collective: a broadcast's root returns once its
data sits in socket buffers, and a rank that arrives first also times its wait for the
last one.  So times are combined across ranks by one small allreduce, and every rank
feeds the same numbers, in the same order, to its estimator.

* Probes (:func:`probe_collectives`) line the ranks up with a tiny allreduce before each
  timed collective and take the **max** over ranks: the collective is done when its
  slowest rank is (and a broadcast's root is never the max).
* Timings of the exchanges themselves (:func:`agree_on_times`) are unaligned: ranks launch
  them after different amounts of local work.  The **min** over ranks is the time seen by
  the last rank to arrive, which waited for nobody.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter

import torch
import torch.distributed as dist

from flexcomm.comm.collectives import allgather, broadcast_from
from flexcomm.cost import Observation


def agree_on_times(seconds: Sequence[float], group: dist.ProcessGroup | None, op: dist.ReduceOp) -> list[float]:
    """Element-wise ``op`` (MIN or MAX) of every rank's list of times; the same list on all ranks."""
    times = torch.tensor(list(seconds), dtype=torch.float64)
    dist.all_reduce(times, op=op, group=group)
    return times.tolist()


def probe_collectives(sizes: Sequence[int], group: dist.ProcessGroup | None) -> list[Observation]:
    """Time allreduce, allgather and broadcast at each size in bytes; identical result on all ranks."""
    world = dist.get_world_size(group)
    kinds = ("allreduce", "allgather", "broadcast")
    plan = [(kind, size) for size in sizes for kind in kinds]
    local = [_timed(kind, size, group) for kind, size in plan]
    merged = agree_on_times(local, group, dist.ReduceOp.MAX)
    return [Observation(kind, size, world, seconds) for (kind, size), seconds in zip(plan, merged)]


def _timed(kind: str, nbytes: int, group: dist.ProcessGroup | None) -> float:
    payload = torch.zeros(max(1, nbytes // 4), dtype=torch.float32)
    dist.all_reduce(torch.zeros(1), group=group)  # line the ranks up
    started = perf_counter()
    if kind == "allreduce":
        dist.all_reduce(payload, group=group)
    elif kind == "allgather":
        allgather(payload, group).wait()
    else:
        broadcast_from(payload, 0, group)
    return perf_counter() - started


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
