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

Local work over the bucket's M elements: ``a = g + e`` into the spare buffer (one pass,
by the memory), the leader's selection (a read, which also sums the squares for the norm;
a follower reads ``a`` once more for it), zeroing the output
(a write); gathering, the residual's zeros and the scatter touch k elements.
"""

from __future__ import annotations

import torch

from flexcomm.comm import allreduce_sum, broadcast_from, clock, used_on_current_stream
from flexcomm.compress.sparse import INDEX_DTYPE
from flexcomm.compress.stats import all_finite, contributed_values, gain, norm_after_selection, norm_and_finiteness
from flexcomm.exchange.job import BucketJob, Timings, report_timings


def exchange_artopk(job: BucketJob) -> torch.futures.Future[torch.Tensor]:
    rec, device = job.record, job.grad.device
    assert job.leaders is not None
    leader = rec.leader = job.leaders.take(job.index, job.step, job.world_size)
    started = clock.now(device)
    indices, norm, finite = select_if_leader(job, leader)
    launched = clock.now(device)
    broadcast_from(indices, leader, job.group)
    broadcasted = clock.now(device)
    values = contribution(job, indices, norm, finite)
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
        spans = (started, launched), (broadcasted, reducing), (done, finished)
        report_timings(job, Timings("allreduce", network, exchange=(launched, done), network=(reducing, done), compress=spans))
        return update

    return allreduce_sum(values, job.group).then(finish)


def select_if_leader(job: BucketJob, leader: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Local work before the broadcast: ``||a_i||``, its finiteness, and the leader's top-k (else a buffer for it)."""
    a = job.accumulated
    if job.rank == leader:
        assert job.selector is not None
        indices = job.selector(a, job.k, job.workspace)
        return indices, *norm_after_selection(a, job.workspace)
    return torch.empty(job.k, dtype=INDEX_DTYPE, device=a.device), *norm_and_finiteness(a)


def contribution(job: BucketJob, indices: torch.Tensor, norm: torch.Tensor, finite: torch.Tensor) -> torch.Tensor:
    """What this rank allreduces: ``a_i[I] / N`` in the gradient's dtype (NaN if ``a_i`` is not finite), then the statistic slots if any.

    Dividing before the sum, as DDP does, keeps an fp16 sum from overflowing.
    """
    a, policy = job.accumulated, job.leaders
    values = contributed_values(a, indices, finite)
    job.outcome.gain = gain(values, norm)
    values = values.div_(job.world_size).to(job.grad.dtype)
    if policy is None or not policy.rides_statistic:
        return values
    slots = values.new_zeros(job.world_size)
    # Clamped to the dtype's range: an fp16 norm can overflow while a_i is finite.
    slots[job.rank] = policy.statistic(a, norm).clamp(max=torch.finfo(values.dtype).max)
    return torch.cat([values, slots])


def apply_update(job: BucketJob, indices: torch.Tensor, reduced: torch.Tensor) -> torch.Tensor:
    """Local work after the allreduce: commit the residual, write ``sum_i a_i[I] / N`` at ``I`` into the bucket."""
    k = job.k
    job.outcome.finite = finite_update = all_finite(reduced)
    if job.leaders is not None and job.leaders.rides_statistic:
        job.outcome.statistics = reduced[k:]
    job.memory.commit(job.index, job.layout, indices, finite_update)
    update = job.grad.zero_()
    return update.index_copy_(0, indices.long(), reduced[:k])
