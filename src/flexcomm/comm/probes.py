"""Probes: timing collectives so that every rank agrees on the result.

A rank's own clock says little about a collective: a broadcast's root returns once its
data sits in socket buffers, and a rank that arrives first also times its wait for the
last one.  So a probe lines the ranks up with a tiny allreduce before each timed
collective and takes the **max** over ranks (one :func:`allreduce_floats`): the
collective is done when its slowest rank is, and a broadcast's root is never the max.
Every rank then feeds the same observations, in the same order, to its estimator.

Sizes are timed in ascending order, one agreed round per size (the first also times a
one-float allreduce, the latency), so that a larger message can be cut to what the agreed
time of the kind's last message says transfers in about
:data:`~flexcomm.cost.PROBE_MESSAGE_SECONDS` (:func:`~flexcomm.cost.probe_size`): on a slow
link the probe's cost is bounded instead of growing with the largest configured size.
"""

from __future__ import annotations

from collections.abc import Sequence
from time import perf_counter

import torch
import torch.distributed as dist

from flexcomm.comm.agreement import allreduce_floats
from flexcomm.comm.collectives import allgather, broadcast_from, control_device
from flexcomm.cost import GLOO_ALGORITHMS, KINDS, Algorithms, CollectiveKind, Observation, link_bound, probe_size


def probe_collectives(sizes: Sequence[int], group: dist.ProcessGroup | None,
                      algorithms: Algorithms = GLOO_ALGORITHMS) -> list[Observation]:
    """Time allreduce, allgather and broadcast at each size in bytes (ascending, each cut by
    :func:`~flexcomm.cost.probe_size` at the kinds' median rate of the round before where slower than
    the kind's own, :func:`~flexcomm.cost.link_bound`, for the collectives' ``algorithms``); identical
    result on all ranks."""
    world = dist.get_world_size(group)
    observations: list[Observation] = []
    last: dict[CollectiveKind, tuple[int, float]] = {}
    latency: float | None = None
    for size in sorted(set(sizes)):
        # Every rank cuts alike: from the agreed (MAX) times of the round before.
        bound = {} if latency is None else link_bound(last, latency, world, algorithms)
        plan = [(kind, size if latency is None else probe_size(size, bound.get(kind), latency)) for kind in KINDS]
        local = [_timed(kind, nbytes, group) for kind, nbytes in plan]
        if latency is None:
            local.append(_timed("allreduce", 4, group))
        merged = allreduce_floats(local, group, dist.ReduceOp.MAX)
        if latency is None:
            latency = merged.pop()
        for (kind, nbytes), seconds in zip(plan, merged):
            observations.append(Observation(kind, nbytes, world, seconds))
            last[kind] = (nbytes, seconds)
    return observations


def _timed(kind: str, nbytes: int, group: dist.ProcessGroup | None) -> float:
    device = control_device(group)
    payload = torch.zeros(max(1, nbytes // 4), dtype=torch.float32, device=device)
    dist.all_reduce(torch.zeros(1, device=device), group=group)  # line the ranks up
    _finish(device)
    started = perf_counter()
    if kind == "allreduce":
        dist.all_reduce(payload, group=group)
    elif kind == "allgather":
        allgather(payload, group).wait()
    else:
        broadcast_from(payload, 0, group)
    _finish(device)
    return perf_counter() - started


def _finish(device: torch.device) -> None:
    """Wait until the device ran what was queued (NCCL's wait() only orders the stream)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
