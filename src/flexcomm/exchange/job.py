"""What one exchange of one bucket needs (:class:`BucketJob`, built by the state) and what it reports (:class:`BucketRecord`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from flexcomm.comm.clock import Mark, readable_now, seconds
from flexcomm.compress import Layout, ResidualMemory, Selector, TopkWorkspace
from flexcomm.compress.fused import Accumulation
from flexcomm.compress.lowrank import LowRankBucket
from flexcomm.exchange.leaders import LeaderPolicy


@dataclass
class BucketRecord:
    """What one bucket's exchange did at one step.

    ``bytes_sent`` is the payload of the collectives this rank took part in (what the
    backend was handed), not wire bytes, which depend on the collective's algorithm.
    ``t_compress`` is all local work of the compressed exchange (selection, gathering the
    values, residual update, writing the result back); ``t_exchange`` runs from the first
    collective's launch to the last one's completion.
    ``gain`` is this rank's ``||sent part of a_i|| / ||a_i||``.  ``predicted`` is the
    cost model's time for the chosen exchange (``flex`` only, else NaN); ``explored``: the
    exchange was ``flex`` trying an alternative, not its plan's choice.  ``quality`` is
    ``cos(update, mean_i g_i)`` on a sample of the bucket's coordinates (the same on every
    rank; measured by the low-rank exchange, NaN elsewhere): how well the applied update
    points along the ranks' mean raw gradient (``benchmarks/quality_signal.py``).
    """

    step: int
    bucket: int
    numel: int
    exchange: str
    k: int
    leader: int
    t_compress: float
    t_exchange: float
    bytes_sent: int
    gain: float
    finite: bool = True
    predicted: float = math.nan
    density: float = math.nan
    explored: bool = False
    quality: float = math.nan

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: ``measured(record, collective kind, payload bytes, seconds)``: a finished exchange's network sample.
Measured = Callable[[BucketRecord, str, int, float], None]


@dataclass(frozen=True)
class Timings:
    """An exchange's time marks (:mod:`flexcomm.comm.clock`): host clocks, or CUDA events read at settle.

    ``exchange``: the first collective's launch to the last one's completion;
    ``network``: the span of the one collective that is a clean network sample of
    ``kind`` (``"allreduce"`` or ``"allgather"``) over ``nbytes`` payload bytes;
    ``compress``: the spans of local work (selection, packing, residual, write-back).
    """

    kind: str
    nbytes: int
    exchange: tuple[Mark, Mark]
    network: tuple[Mark, Mark]
    compress: tuple[tuple[Mark, Mark], ...] = ()


@dataclass
class DeviceOutcome:
    """What an exchange learned, as 0-d device tensors until the state settles the step.

    ``gain``: ``||sent part of a_i|| / ||a_i||``; ``quality``: the record's ``quality``; ``finite``: whether the exchanged update
    is finite; ``statistics``: every rank's leader statistic (VAR-Topk), kept only if finite;
    ``timings``: the exchange's CUDA-event marks (host marks are reported at once).
    """

    gain: torch.Tensor | None = None
    quality: torch.Tensor | None = None
    finite: torch.Tensor | None = None
    statistics: torch.Tensor | None = None
    timings: Timings | None = None


def report_timings(job: BucketJob, timings: Timings) -> None:
    """Fill the record's times and report the network sample: now for host marks, at settle for CUDA events."""
    if readable_now(timings.exchange[0]):
        apply_timings(job.record, timings, job.measured)
    else:
        job.outcome.timings = timings


def apply_timings(record: BucketRecord, timings: Timings, measured: Measured) -> None:
    """Set ``t_exchange`` and ``t_compress`` of ``record`` from ``timings``; hand the network sample to ``measured``."""
    record.t_exchange = seconds(*timings.exchange)
    record.t_compress = sum(seconds(*span) for span in timings.compress)
    measured(record, timings.kind, timings.nbytes, seconds(*timings.network))


@dataclass
class BucketJob:
    """One bucket's exchange at one step.

    ``grad`` is the bucket's own buffer: the exchange writes the averaged update into it.
    ``accumulated`` is the error-corrected gradient ``a_i = g_i + e_i``: ``grad`` itself
    for a dense exchange (compensated in place), else the residual's own buffer, which
    becomes the new residual when the exchange commits it.  For a sparse exchange
    ``accumulation`` is what that pass produced (:meth:`~flexcomm.compress.ResidualMemory.accumulate`:
    ``grad`` already zeroed, ``||a_i||``, and the top-k on a rank that selects with the
    exact top-k), and ``accumulation_span`` its time marks (local work of the exchange).
    ``leader`` is the AR-Topk index source (-1 for other exchanges); ``low_rank`` the
    low-rank exchange's split and queries (``None`` for other exchanges); ``sampled_grad`` is
    ``g_i / N`` at the bucket's ``sample`` positions, taken before the accumulation pass zeroed
    the bucket, for an exchange that measures its ``quality``.  ``record`` arrives
    with the step, bucket, exchange, k and density filled in; the exchange fills in its
    host-side measurements and puts its device-side ones in ``outcome``.  ``selector``
    and ``leaders`` are set when the exchange needs them.
    """

    grad: torch.Tensor
    accumulated: torch.Tensor
    index: int
    layout: Layout
    k: int
    step: int
    group: dist.ProcessGroup | None
    world_size: int
    rank: int
    memory: ResidualMemory
    workspace: TopkWorkspace
    record: BucketRecord
    outcome: DeviceOutcome
    measured: Measured
    selector: Selector | None = None
    leaders: LeaderPolicy | None = None
    accumulation: Accumulation | None = None
    accumulation_span: tuple[Mark, Mark] | None = None
    leader: int = -1
    low_rank: LowRankBucket | None = None
    sample: slice | None = None
    sampled_grad: torch.Tensor | None = None
    #: Where an exchange defers its second half (see :mod:`flexcomm.comm.dispatch`); None: run it at once.
    defer: Callable[[Callable[[], None], torch.futures.Future], None] | None = None

    def selected(self) -> torch.Tensor:
        """This rank's selection of ``accumulated``: the accumulation pass's top-k, else the selector's."""
        if self.accumulation is not None and self.accumulation.indices is not None:
            return self.accumulation.indices
        assert self.selector is not None
        return self.selector(self.accumulated, self.k, self.workspace)

    def local_spans(self, *spans: tuple[Mark, Mark]) -> tuple[tuple[Mark, Mark], ...]:
        """The exchange's local-work spans, the accumulation pass's first."""
        return spans if self.accumulation_span is None else (self.accumulation_span, *spans)
