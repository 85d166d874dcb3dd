"""Dense exchange: allreduce the whole bucket; the update is ``sum_i (a_i / N)``; no residual.

Without a residual this is exactly DDP's own allreduce hook: one division and one
allreduce of the bucket in place, no extra pass and no bookkeeping.  As in DDP, each rank
divides before the sum, so an fp16 sum of N large gradients does not overflow.  A bucket that still
carries a residual (``flex`` or the density controller just went dense) adds it first
and drops it once the step is known to be finite (a non-finite step keeps it, as the
step GradScaler skips would have).
"""

from __future__ import annotations

import torch

from flexcomm.comm import allreduce_sum, clock
from flexcomm.compress.stats import all_finite
from flexcomm.exchange.job import BucketJob, Timings, report_timings


def exchange_dense(job: BucketJob) -> torch.futures.Future[torch.Tensor]:
    a, rec = job.accumulated, job.record
    had_residual = job.memory.holds(job.index)
    rec.bytes_sent = a.numel() * a.element_size()
    rec.gain = 1.0
    a.div_(job.world_size)
    started = clock.now(a.device)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        total = fut.value()
        done = clock.now(a.device)
        report_timings(job, Timings("allreduce", rec.bytes_sent, exchange=(started, done), network=(started, done)))
        if had_residual:
            drop_sent_residual(job, total)
        return total

    return allreduce_sum(a, job.group).then(finish)


def drop_sent_residual(job: BucketJob, update: torch.Tensor) -> None:
    """The residual went out with this dense update: drop it once the update is known to be finite."""
    job.outcome.finite = finite = all_finite(update)
    job.memory.forget_if(job.index, finite)
