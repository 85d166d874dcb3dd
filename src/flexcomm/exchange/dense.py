"""Dense exchange: allreduce the whole bucket; the update is ``sum_i a_i / N``; no residual."""

from __future__ import annotations

from time import perf_counter

import torch

from flexcomm.comm import allreduce_sum
from flexcomm.exchange.job import BucketJob


def exchange_dense(job: BucketJob) -> torch.futures.Future[torch.Tensor]:
    a, rec = job.accumulated, job.record
    had_residual = job.memory.residual(job.index) is not None
    rec.bytes_sent = a.numel() * a.element_size()
    rec.gain = 1.0
    started = perf_counter()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        total = fut.value().div_(job.world_size)
        rec.t_exchange = perf_counter() - started
        job.measured(rec, "allreduce", rec.bytes_sent, rec.t_exchange)
        # Only a bucket that still carries a residual needs the (full-pass) check: a
        # non-finite step must not wipe the residual that the skipped step would have kept.
        if had_residual:
            rec.finite = bool(torch.isfinite(total).all())
            if rec.finite:
                job.memory.forget(job.index)
        return total

    return allreduce_sum(a, job.group).then(finish)
