"""Low-rank exchange (``lowrank``, PowerSGD's subspace iteration): two allreduces of thin factors.

With the math of :mod:`flexcomm.compress.lowrank` (``M_i`` a compressed matrix of rank i's
error-corrected bucket, ``Q`` its warm-start query, equal on every rank):

1. ``P_i = M_i Q`` for every matrix, packed with the bucket's other parameters divided by N
   (``rest_i / N``) into one buffer, allreduced (sum); the rest is the exchange's second half,
   which the dispatcher runs after the next bucket's collectives were issued (at a step's last
   bucket, at once), so the round trip overlaps that bucket's work and every rank issues the
   collectives in the same order (:mod:`flexcomm.comm.dispatch`, "Second halves");
2. each ``P`` is orthonormalized (equal on every rank); ``Q_i^T = P^T M_i``; the residual
   becomes ``M_i - P Q_i^T`` (in place: ``a_i`` is the residual's own buffer) and 0 on the
   rest, which went whole; the ``Q_i^T`` are packed and allreduced (sum), asynchronously;
3. the update is ``P (sum_i Q_i)^T / N`` on each matrix and ``sum_i rest_i / N`` on the rest,
   written into the (zeroed) bucket; ``sum_i Q_i`` becomes the next step's query.

A non-finite ``a_i`` on any rank makes the first buffer NaN on every rank (``nan_unless``),
so the update is NaN everywhere and every rank drops its residual, as for the top-k
exchanges.  The factors travel in the residual's dtype (fp32; fp64 for fp64 gradients).  Bytes per
rank: ``4 * (sum (n + m) r + rest)``, in two collectives, plus (when the
state asks for the update's quality) the rank's raw gradient at a shared sample of coordinates,
divided by N, appended to the second: its sum is the mean gradient there, against which the
update's cosine is taken (the record's ``quality``; identical on every rank).

The second allreduce is the exchange's network sample.  A deferred half's second allreduce
queues behind the next bucket's first one, which no sample reports, so its span also holds that
transfer: where a low-rank bucket follows another, flex's service time of the earlier one is
over-stated by the later one's first allreduce (small where that is P factors, large where the
bucket sends big parameters whole).  Not corrected yet.
"""

from __future__ import annotations

import torch

from flexcomm.comm import allreduce_sum, clock, forward_to, future_devices, used_on_current_stream
from flexcomm.compress.lowrank import factor_dtype, orthonormalize_
from flexcomm.compress.stats import all_finite, cosine, nan_unless
from flexcomm.exchange.job import BucketJob, Timings, report_timings


def exchange_lowrank(job: BucketJob) -> torch.futures.Future[torch.Tensor]:
    a, rec, n = job.accumulated, job.record, job.world_size
    accumulation, low_rank = job.accumulation, job.low_rank
    assert accumulation is not None and low_rank is not None
    split, queries, device = low_rank.split, low_rank.queries, job.grad.device
    matrices, rest = split.views(a)
    dtype = factor_dtype(a.dtype)
    started = clock.now(device)
    first = torch.empty(split.p_numel + split.rest_numel, dtype=dtype, device=device)
    ps = split.factor_views(first, "p")
    for m, q, p in zip(matrices, queries, ps):
        # Q laid out (r, m) and read transposed: BLAS streams M once (4.5 against 8 ms at 2500 x 2500).
        torch.matmul(m, q.to(dtype).t().contiguous().t(), out=p)
    rest_energy = _pack_rest(first[split.p_numel :], rest, n)
    nan_unless(first, accumulation.finite)
    sampled = job.sampled_grad
    extra = 0 if sampled is None else sampled.numel()
    second = torch.empty(split.q_numel + extra, dtype=dtype, device=device)
    if sampled is not None:  # the ranks' g_i / N at the sample ride along: their sum is the mean gradient there
        second[split.q_numel :].copy_(sampled)
    rec.k = first.numel() + split.q_numel  # the update's payload; the quality sample is in the bytes only
    rec.bytes_sent = (first.numel() + second.numel()) * first.element_size()
    launched = clock.now(device)
    reduced_first = allreduce_sum(first, job.group)
    result: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=future_devices(job.grad))

    def second_half() -> None:
        try:
            reduced_first.wait()
            reduced = clock.now(device)
            own_qts = split.factor_views(second, "q")
            for m, p, qt_i in zip(matrices, ps, own_qts):
                orthonormalize_(p)
                torch.matmul(p.t(), m, out=qt_i)  # Q_i^T = P^T M_i
                m.addmm_(p, qt_i, alpha=-1.0)  # e_i = M_i - P Q_i^T: what this rank's projection left behind
            job.outcome.gain = _gain(second[: split.q_numel], rest_energy, accumulation.norm)
            issued = clock.now(device)

            def finish(fut: torch.futures.Future) -> torch.Tensor:
                fut.value()
                done = clock.now(device)
                used_on_current_stream(first)
                used_on_current_stream(second)  # _apply_update reads both on the callback's stream
                update = _apply_update(job, first, second)
                finished = clock.now(device)
                spans = job.local_spans((started, launched), (reduced, issued), (done, finished))
                # The second allreduce, timed from its own launch, is the network sample (a deferred
                # half's also holds the next bucket's first allreduce: see the module docstring).
                nbytes = second.numel() * second.element_size()
                report_timings(job, Timings("allreduce", nbytes, exchange=(launched, done), network=(issued, done),
                                            compress=spans))
                return update

            allreduce_sum(second, job.group).then(finish).add_done_callback(forward_to(result))
        except BaseException as err:
            result.set_exception(err)
            raise

    # The first allreduce's round trip overlaps the next bucket's work and collectives.
    if job.defer is None:
        second_half()
    else:
        job.defer(second_half, result)
    return result


def _pack_rest(out: torch.Tensor, rest: list[torch.Tensor], world_size: int) -> torch.Tensor:
    """The parameters sent whole, ``rest_i / N``, into ``out``; they leave the residual.  Returns ``||rest_i||^2``."""
    energy = out.new_zeros(())
    offset = 0
    for piece in rest:
        energy += piece.square().sum(dtype=out.dtype)
        out[offset : offset + piece.numel()].copy_(piece).div_(world_size)
        piece.zero_()
        offset += piece.numel()
    return energy


def _gain(own_qts: torch.Tensor, rest_energy: torch.Tensor, norm: torch.Tensor) -> torch.Tensor:
    """``||sent part of a_i|| / ||a_i||``: ``||P Q_i^T||^2 = ||Q_i||^2`` (P orthonormal), plus the rest, sent whole."""
    sent = (own_qts.square().sum() + rest_energy).sqrt()
    return torch.where(norm == 0, torch.zeros_like(norm), sent / norm)


def _apply_update(job: BucketJob, first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """Write ``P (sum_i Q_i)^T / N`` and ``sum_i rest_i / N`` into the (zeroed) bucket; commit the residual;
    ``sum_i Q_i`` becomes each matrix's next query if the update is finite (a NaN query would stay NaN)."""
    low_rank, grad, n = job.low_rank, job.grad, job.world_size
    assert low_rank is not None
    split = low_rank.split
    job.outcome.finite = finite = all_finite(first) & all_finite(second[: split.q_numel])
    job.memory.commit(job.index, finite)
    matrices, rest = split.views(grad)
    ps, total_qts = split.factor_views(first, "p"), split.factor_views(second, "q")
    for m, p, total_qt, query in zip(matrices, ps, total_qts, low_rank.queries):
        scaled = total_qt / n  # divide the thin factor, not the matrix
        if m.dtype == p.dtype:
            torch.mm(p, scaled, out=m)
        else:
            m.copy_(torch.mm(p, scaled))
        query.copy_(torch.where(finite, total_qt.t(), query))
    rest_total, offset = first[split.p_numel :], 0
    for piece in rest:
        piece.copy_(rest_total[offset : offset + piece.numel()])
        offset += piece.numel()
    if job.sample is not None:
        job.outcome.quality = cosine(grad[job.sample], second[split.q_numel :])
    return grad
