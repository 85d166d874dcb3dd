"""Allgather exchange (AG-Topk, MSTopk): every rank sends its own selection.

Rank i selects indices ``I_i`` of ``|a_i|`` (exact top-k or MSTopk) and sends k values
plus k int32 indices in one allgather; the update is ``sum_i a_i[I_i] / N`` scattered at
the ``I_i`` (overlaps add); rank i keeps ``e_i = a_i`` with ``I_i`` zeroed.
"""

from __future__ import annotations

from time import perf_counter

import torch

from flexcomm.comm import allgather
from flexcomm.compress import pack, unpack_all
from flexcomm.compress.stats import contributed_values, gain, norm_and_finiteness
from flexcomm.exchange.job import BucketJob


def exchange_allgather(job: BucketJob) -> torch.futures.Future[torch.Tensor]:
    a, rec, k = job.accumulated, job.record, job.k
    assert job.selector is not None
    started = perf_counter()
    norm, finite = norm_and_finiteness(a)
    indices = job.selector(a, k, job.workspace)
    values = contributed_values(a, indices, finite)
    rec.gain = gain(values, norm)
    # MSTopk may find fewer than k; pad the message with zero values at index 0 so that
    # every rank's message has the same size (adding zeros changes nothing).
    padding = k - indices.numel()
    message = pack(torch.cat([values, values.new_zeros(padding)]), torch.cat([indices, indices.new_zeros(padding)]))
    rec.bytes_sent = message.numel()
    rec.t_compress = perf_counter() - started
    launched = perf_counter()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        done = perf_counter()
        rec.t_exchange = done - launched
        all_values, all_indices = unpack_all(fut.value(), job.world_size, k, a.dtype)
        rec.finite = bool(torch.isfinite(all_values).all())
        if rec.finite:
            job.memory.update(job.index, job.layout, a, indices)
        a.zero_()
        a.index_add_(0, all_indices, all_values.div_(job.world_size))
        rec.t_compress += perf_counter() - done
        job.measured(rec, "allgather", rec.bytes_sent, rec.t_exchange)
        return a

    return allgather(message, job.group).then(finish)
