"""What one exchange of one bucket needs (:class:`BucketJob`, built by the state) and what it reports (:class:`BucketRecord`)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import torch.distributed as dist

from flexcomm.compress import Layout, ResidualMemory, Selector, TopkWorkspace
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
    cost model's time for the chosen exchange (``flex`` only, else NaN).
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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


#: ``measured(record, collective kind, payload bytes, seconds)``: a finished exchange's network sample.
Measured = Callable[[BucketRecord, str, int, float], None]


@dataclass
class DeviceOutcome:
    """What an exchange learned, as 0-d device tensors until the state settles the step.

    ``gain``: ``||sent part of a_i|| / ||a_i||``; ``finite``: whether the exchanged update
    is finite; ``statistics``: every rank's leader statistic (VAR-Topk), kept only if finite.
    """

    gain: torch.Tensor | None = None
    finite: torch.Tensor | None = None
    statistics: torch.Tensor | None = None


@dataclass
class BucketJob:
    """One bucket's exchange at one step.

    ``grad`` is the bucket's own buffer: the exchange writes the averaged update into it.
    ``accumulated`` is the error-corrected gradient ``a_i = g_i + e_i``: ``grad`` itself
    for a dense exchange (compensated in place), else the residual memory's spare buffer
    (:meth:`~flexcomm.compress.ResidualMemory.accumulate`), which becomes the new residual
    when the exchange commits it.  ``record`` arrives with the step, bucket, exchange, k
    and density filled in; the exchange fills in its host-side measurements and puts its
    device-side ones in ``outcome``.  ``selector`` and ``leaders`` are set when the
    exchange needs them.
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
