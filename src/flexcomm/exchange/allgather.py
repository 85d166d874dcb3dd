"""Allgather exchange (AG-Topk, MSTopk): every rank sends its own selection.

Rank i selects indices ``I_i`` of ``|a_i|`` (exact top-k or MSTopk) and sends k values
plus k int32 indices in one allgather; the update is ``sum_i a_i[I_i] / N`` scattered at
the ``I_i`` (overlaps add); rank i keeps ``e_i = a_i`` with ``I_i`` zeroed.

Local work over the bucket's M elements: one pass, by the memory (:mod:`flexcomm.compress.fused`):
``a = g + e`` over the residual, the bucket zeroed, ``||a_i||`` and the exact top-k (MSTopk
reads ``a`` again for its own search); everything else touches k or N*k elements.
"""

from __future__ import annotations

import torch

from flexcomm.comm import allgather, clock, used_on_current_stream
from flexcomm.compress import pack, unpack_all
from flexcomm.compress.stats import all_finite, gain, nan_unless
from flexcomm.exchange.job import BucketJob, Timings, report_timings


def exchange_allgather(job: BucketJob) -> torch.futures.Future[torch.Tensor]:
    rec, device = job.record, job.grad.device
    started = clock.now(device)
    message, indices = contribution(job)
    rec.bytes_sent = message.numel()
    launched = clock.now(device)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        done = clock.now(device)
        used_on_current_stream(indices)
        update = apply_update(job, indices, fut.value())
        finished = clock.now(device)
        spans = job.local_spans((started, launched), (done, finished))
        report_timings(job, Timings("allgather", rec.bytes_sent, exchange=(launched, done), network=(launched, done), compress=spans))
        return update

    return allgather(message, job.group).then(finish)


def contribution(job: BucketJob) -> tuple[torch.Tensor, torch.Tensor]:
    """Local work before the allgather: select, take the values out of the residual (NaN if ``a_i`` is not finite), divide by N, pack.

    The values travel in the gradient's dtype (``a_i`` is fp32 for half-precision
    gradients, see :mod:`flexcomm.compress.memory`), divided by N first as DDP does.
    """
    k, accumulation = job.k, job.accumulation
    assert accumulation is not None
    indices = job.selected()
    values = nan_unless(job.memory.take(job.index, indices), accumulation.finite)
    job.outcome.gain = gain(values, accumulation.norm)
    values = values.div_(job.world_size).to(job.grad.dtype)
    # MSTopk may find fewer than k; pad the message with zero values at index 0 so that
    # every rank's message has the same size (adding zeros changes nothing).
    padding = k - indices.numel()
    return pack(torch.cat([values, values.new_zeros(padding)]), torch.cat([indices, indices.new_zeros(padding)])), indices


def apply_update(job: BucketJob, indices: torch.Tensor, gathered: torch.Tensor) -> torch.Tensor:
    """Local work after the allgather: commit the residual, add every rank's values into the (zeroed) bucket.

    One ``index_add_`` per source rank, in rank order: within a rank the indices are
    distinct (MSTopk's padding adds exact zeros), so no two atomic adds on a GPU meet at
    one element with different values and every replica sums in the same order (one call
    over all ranks' indices is non-deterministic on CUDA: replicas would drift bitwise).
    """
    all_values, all_indices = unpack_all(gathered, job.world_size, job.k, job.grad.dtype)
    job.outcome.finite = finite_update = all_finite(all_values)
    job.memory.commit(job.index, finite_update)
    update = job.grad  # zeroed by the accumulation pass
    for source_values, source_indices in zip(all_values.view(job.world_size, -1), all_indices.view(job.world_size, -1)):
        update.index_add_(0, source_indices, source_values)
    return update
