"""Half-precision dense exchange (``dense16``): the bucket allreduced in fp16, half of dense's bytes.

The update is ``widen(sum_i fp16(a_i / N))``, the sum taken in fp16: what PyTorch's
``fp16_compress_hook`` computes.  ``flex`` chooses it per bucket like the other exchanges,
and only for buckets wider than 16 bits (fp32 gradients): it trades half of a dense
allreduce's bytes for two passes of local work (divide and narrow, then widen into the
bucket).  Each rank divides before narrowing, as DDP does, so the sum of N gradients
cannot overflow where one alone does not.

What it gives up, exactly as PyTorch's hook: the rounding to fp16's 11-bit significand
(relative error at most 2^-11 per element, not fed back into a residual), values below
fp16's smallest subnormal (~6e-8 after the division) flushed to zero, and values above its
largest (65504) turned into inf.  ``FlexState(dense16=False)`` keeps ``flex`` off it.
A bucket that still carries a residual adds it first and drops it once the step is
finite, as the fp32 dense exchange does.
"""

from __future__ import annotations

import torch

from flexcomm.comm import allreduce_sum, clock
from flexcomm.cost.model import HALF_BYTES
from flexcomm.exchange.dense import drop_sent_residual
from flexcomm.exchange.job import BucketJob, Timings, report_timings

HALF_DTYPE = torch.float16


def exchange_dense16(job: BucketJob) -> torch.futures.Future[torch.Tensor]:
    a, rec, device = job.accumulated, job.record, job.grad.device
    if a.element_size() <= HALF_BYTES:
        raise ValueError(f"dense16 halves the bytes of wider gradients only; this bucket is {a.dtype}")
    had_residual = job.memory.holds(job.index)
    started = clock.now(device)
    half = a.div_(job.world_size).to(HALF_DTYPE)
    rec.bytes_sent = half.numel() * half.element_size()
    rec.gain = 1.0
    launched = clock.now(device)

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        total = fut.value()
        done = clock.now(device)
        update = a.copy_(total)
        widened = clock.now(device)
        spans = (started, launched), (done, widened)
        report_timings(job, Timings("allreduce", rec.bytes_sent, exchange=(launched, done), network=(launched, done), compress=spans))
        if had_residual:
            drop_sent_residual(job, update)
        return update

    return allreduce_sum(half, job.group).then(finish)
