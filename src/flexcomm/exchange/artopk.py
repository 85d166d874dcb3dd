"""Broadcast-indices + allreduce-values exchange (AR-Topk: STAR-Topk, VAR-Topk).

The leader policy names one rank r; r selects the top-k indices ``I`` of ``|a_r|`` and
broadcasts them (k int32); every rank gathers ``a_i[I]`` and allreduces these k values;
the update is ``sum_i a_i[I] / N`` at ``I``, zero elsewhere; every rank keeps
``e_i = a_i`` with ``I`` zeroed.  A policy whose statistic rides along appends N slots
to the values (rank i's statistic in slot i, zeros elsewhere), so the allreduce hands
every rank every rank's statistic.

The chain runs on the hook's dispatcher thread (:mod:`flexcomm.comm.dispatch`): the wait
for the broadcast indices holds that thread, never backward, and the allreduce is
issued before the next bucket's first collective on every rank.

Local work over the bucket's M elements: one pass, by the memory (:mod:`flexcomm.compress.fused`):
``a = g + e`` over the residual, the bucket zeroed, ``||a_i||``, and on the leader the
top-k; gathering, the residual's zeros and the scatter touch k elements.
"""

from __future__ import annotations

import torch

from flexcomm.comm import allreduce_sum, broadcast_from, clock, used_on_current_stream
from flexcomm.compress.sparse import INDEX_DTYPE
from flexcomm.compress.stats import all_finite, gain, nan_unless
from flexcomm.exchange.job import BucketJob, Timings, report_timings


def exchange_artopk(job: BucketJob) -> torch.futures.Future[torch.Tensor]:
    rec, device, leader = job.record, job.grad.device, job.leader
    started = clock.now(device)
    indices = indices_to_broadcast(job)
    launched = clock.now(device)
    broadcast_from(indices, leader, job.group)
    broadcasted = clock.now(device)
    values = contribution(job, indices)
    rec.bytes_sent = indices.numel() * indices.element_size() + values.numel() * values.element_size()
    reducing = clock.now(device)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()
        done = clock.now(device)
        used_on_current_stream(indices)
        update = apply_update(job, indices, reduced)
        finished = clock.now(device)
        # Only the allreduce, timed from its own launch, is a clean network sample: a
        # non-leader's broadcast time includes its wait for the leader's top-k.
        network = values.numel() * values.element_size()
        spans = job.local_spans((started, launched), (broadcasted, reducing), (done, finished))
        report_timings(job, Timings("allreduce", network, exchange=(launched, done), network=(reducing, done), compress=spans))
        return update

    return allreduce_sum(values, job.group).then(finish)


def indices_to_broadcast(job: BucketJob) -> torch.Tensor:
    """The leader's top-k of ``|a|``; on the other ranks a buffer the broadcast fills."""
    if job.rank == job.leader:
        return job.selected()
    return torch.empty(job.k, dtype=INDEX_DTYPE, device=job.accumulated.device)


def contribution(job: BucketJob, indices: torch.Tensor) -> torch.Tensor:
    """What this rank allreduces: ``a_i[I] / N`` in the gradient's dtype (NaN if ``a_i`` is not finite), then the statistic slots if any.

    The values leave the residual here (:meth:`~flexcomm.compress.ResidualMemory.take`).

    Dividing before the sum, as DDP does, keeps an fp16 sum from overflowing.
    """
    a, policy, accumulation = job.accumulated, job.leaders, job.accumulation
    assert accumulation is not None
    # The statistic reads a_i before the sent values leave it.
    statistic = policy.statistic(a, accumulation.norm) if policy is not None and policy.rides_statistic else None
    values = nan_unless(job.memory.take(job.index, indices), accumulation.finite)
    job.outcome.gain = gain(values, accumulation.norm)
    values = values.div_(job.world_size).to(job.grad.dtype)
    if statistic is None:
        return values
    slots = values.new_zeros(job.world_size)
    # Clamped to the dtype's range: an fp16 norm can overflow while a_i is finite.
    slots[job.rank] = statistic.clamp(max=torch.finfo(values.dtype).max)
    return torch.cat([values, slots])


def apply_update(job: BucketJob, indices: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
    """Local work after the allreduce: commit the residual, write ``sum_i a_i[I] / N`` at ``I`` into the (zeroed) bucket."""
    k = job.k
    job.outcome.finite = finite_update = all_finite(reduced)
    if job.leaders is not None and job.leaders.rides_statistic:
        job.outcome.statistics = reduced[k:]
    job.memory.commit(job.index, finite_update)
    # The accumulation pass zeroed the bucket.
    return job.grad.index_copy_(0, indices.long(), reduced[:k])
