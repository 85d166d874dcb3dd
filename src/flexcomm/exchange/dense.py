"""Dense exchange: allreduce the whole bucket; the update is ``sum_i a_i / N``; no residual.

Without a residual this is exactly DDP's own allreduce hook: one allreduce of the bucket
in place and one division, no extra pass and no bookkeeping.  A bucket that still
carries a residual (``flex`` or the density controller just went dense) adds it first
and drops it once the step is known to be finite (a non-finite step keeps it, as the
step GradScaler skips would have).
"""

from __future__ import annotations

from time import perf_counter

import torch

from flexcomm.comm import allreduce_sum
from flexcomm.compress.stats import all_finite
from flexcomm.exchange.job import BucketJob


def exchange_dense(job: BucketJob) -> torch.futures.Future[torch.Tensor]:
    a, rec = job.accumulated, job.record
    had_residual = job.memory.holds(job.index)
    rec.bytes_sent = a.numel() * a.element_size()
    rec.gain = 1.0
    started = perf_counter()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        total = fut.value().div_(job.world_size)
        rec.t_exchange = perf_counter() - started
        job.measured(rec, "allreduce", rec.bytes_sent, rec.t_exchange)
        if had_residual:
            job.outcome.finite = finite = all_finite(total)
            job.memory.forget_if(job.index, finite)
        return total

    return allreduce_sum(a, job.group).then(finish)
