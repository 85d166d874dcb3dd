"""What one exchange of one bucket needs: :class:`BucketJob`, built by the state."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flexcomm.compress import Layout, ResidualMemory, Selector, TopkWorkspace
from flexcomm.exchange.leaders import LeaderPolicy

if TYPE_CHECKING:
    from flexcomm.state import BucketRecord

#: ``measured(record, collective kind, payload bytes, seconds)``: a finished exchange's network sample.
Measured = Callable[["BucketRecord", str, int, float], None]


@dataclass
class BucketJob:
    """One bucket's exchange at one step.

    ``accumulated`` is the error-corrected gradient ``a_i = g_i + e_i`` in the bucket's own
    buffer; the exchange writes the averaged update back into it.  ``record`` arrives
    with the step, bucket, exchange, k and density filled in; the exchange fills in what
    it measured.  ``selector`` and ``leaders`` are set when the exchange needs them.
    """

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
    measured: Measured
    selector: Selector | None = None
    leaders: LeaderPolicy | None = None
