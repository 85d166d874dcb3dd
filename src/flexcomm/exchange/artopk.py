"""Broadcast-indices + allreduce-values exchange (AR-Topk: STAR-Topk, VAR-Topk).

The leader policy names one rank r; r selects the top-k indices ``I`` of ``|a_r|`` and
broadcasts them (k int32); every rank gathers ``a_i[I]`` and allreduces these k values;
the update is ``sum_i a_i[I] / N`` at ``I``, zero elsewhere; every rank keeps
``e_i = a_i`` with ``I`` zeroed.  A policy whose statistic rides along appends N slots
to the values (rank i's statistic in slot i, zeros elsewhere), so the allreduce hands
every rank every rank's statistic.
"""

from __future__ import annotations

from time import perf_counter

import torch

from flexcomm.comm import allreduce_sum, broadcast_from
from flexcomm.compress.stats import contributed_values, gain, norm_and_finiteness
from flexcomm.exchange.job import BucketJob


def exchange_artopk(job: BucketJob) -> torch.futures.Future[torch.Tensor]:
    a, rec, k, world = job.accumulated, job.record, job.k, job.world_size
    policy, select = job.leaders, job.selector
    assert policy is not None and select is not None
    leader = rec.leader = policy.take(job.index, job.step, world)
    started = perf_counter()
    norm, finite = norm_and_finiteness(a)
    if job.rank == leader:
        indices = select(a, k, job.workspace)
    else:
        indices = torch.empty(k, dtype=torch.int32, device=a.device)
    t_compress = perf_counter() - started

    launched = perf_counter()
    broadcast_from(indices, leader, job.group)
    broadcasted = perf_counter()
    values = contributed_values(a, indices, finite)
    rec.gain = gain(values, norm)
    if policy.rides_statistic:
        slots = values.new_zeros(world)
        # Clamped to the dtype's range: an fp16 norm can overflow while a_i is finite.
        slots[job.rank] = min(policy.statistic(a, norm), torch.finfo(values.dtype).max)
        values = torch.cat([values, slots])
    rec.bytes_sent = indices.numel() * indices.element_size() + values.numel() * values.element_size()
    rec.t_compress = t_compress + perf_counter() - broadcasted
    reducing = perf_counter()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()
        done = perf_counter()
        rec.t_exchange = done - launched
        rec.finite = bool(torch.isfinite(reduced).all())
        if rec.finite:
            job.memory.update(job.index, job.layout, a, indices)
            if policy.rides_statistic:
                policy.observe(job.index, reduced[k:].double().tolist())
        a.zero_()
        a[indices.long()] = reduced[:k].div_(world)
        rec.t_compress += perf_counter() - done
        # Only the allreduce, timed from its own launch, is a clean network sample: a
        # non-leader's broadcast time includes its wait for the leader's top-k.
        job.measured(rec, "allreduce", values.numel() * values.element_size(), done - reducing)
        return a

    return allreduce_sum(values, job.group).then(finish)
