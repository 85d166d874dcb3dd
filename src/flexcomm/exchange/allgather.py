"""Allgather exchange (AG-Topk, MSTopk): every rank sends its own selection.

Rank i selects indices ``I_i`` of ``|a_i|`` (exact top-k or MSTopk) and sends k values
plus k int32 indices in one allgather; the update is ``sum_i a_i[I_i] / N`` scattered at
the ``I_i`` (overlaps add); rank i keeps ``e_i = a_i`` with ``I_i`` zeroed.

Local work over the bucket's M elements: ``a = g + e`` into the spare buffer (one pass,
by the memory), the selection (a read, which also sums the squares for the norm),
zeroing the output (a write);
everything else touches k or N*k elements.
"""

from __future__ import annotations

from time import perf_counter

import torch

from flexcomm.comm import allgather
from flexcomm.compress import pack, unpack_all
from flexcomm.compress.stats import all_finite, contributed_values, gain, norm_after_selection
from flexcomm.exchange.job import BucketJob


def exchange_allgather(job: BucketJob) -> torch.futures.Future[torch.Tensor]:
    rec = job.record
    started = perf_counter()
    message, indices = contribution(job)
    rec.bytes_sent = message.numel()
    rec.t_compress = perf_counter() - started
    launched = perf_counter()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        done = perf_counter()
        rec.t_exchange = done - launched
        update = apply_update(job, indices, fut.value())
        rec.t_compress += perf_counter() - done
        job.measured(rec, "allgather", rec.bytes_sent, rec.t_exchange)
        return update

    return allgather(message, job.group).then(finish)


def contribution(job: BucketJob) -> tuple[torch.Tensor, torch.Tensor]:
    """Local work before the allgather: select, gather the values (NaN if ``a_i`` is not finite), pack."""
    a, k = job.accumulated, job.k
    assert job.selector is not None
    indices = job.selector(a, k, job.workspace)
    norm, finite = norm_after_selection(a, job.workspace)
    values = contributed_values(a, indices, finite)
    job.outcome.gain = gain(values, norm)
    # MSTopk may find fewer than k; pad the message with zero values at index 0 so that
    # every rank's message has the same size (adding zeros changes nothing).
    padding = k - indices.numel()
    return pack(torch.cat([values, values.new_zeros(padding)]), torch.cat([indices, indices.new_zeros(padding)])), indices


def apply_update(job: BucketJob, indices: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """Local work after the allgather: commit the residual, scatter-add every rank's values over N into the bucket."""
    all_values, all_indices = unpack_all(gathered, job.world_size, job.k, job.accumulated.dtype)
    job.outcome.finite = finite_update = all_finite(all_values)
    job.memory.commit(job.index, job.layout, indices, finite_update)
    update = job.grad.zero_()
    return update.index_add_(0, all_indices, all_values.div_(job.world_size))
