"""An agreement point's collectives: issued at the end of the step before it, read at its first bucket.

A latency-bound allreduce at a step's first bucket, before that bucket's exchange, puts about
two round trips on the critical path of every agreement step (``latency_switching``: flex at
1.99x the per-case best on 1-32 ms links).  So the planner issues an agreement point's
collectives asynchronously (:func:`~flexcomm.comm.allreduce_floats_async`) on the hook's
dispatcher thread right after the previous step's last bucket's exchange was issued, and
reads them at the agreement point's first bucket: the wait overlaps the optimizer step and
the next forward and backward, and the first bucket's exchange is the step's first collective.

Order and lengths: DDP marks the step's last bucket on every rank and the dispatcher runs
tasks in bucket order, so every rank issues these collectives at the same place in its
sequence; whether each runs and its length follow from the step counter, the configuration
and the exchanges every rank planned (:mod:`flexcomm.control.measurements`), never from
rank-local samples.  What they carry:

* the measurements of the steps closed by then (MAX, laid out by
  :mod:`~flexcomm.control.measurements`): every step up to the one two before the agreement
  point -- the step just before is still exchanging when the allreduce is issued, so its
  samples go to the next agreement point;
* the gain curve (``density="auto"``) measured during the step just before (SUM): its
  buckets' gains are observed before their exchanges, so the curve is complete by then.

A checkpoint taken in between stores the agreed values (:meth:`AgreementPoint.state_dict`
waits for them), so a resumed run reads what the uninterrupted one reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from flexcomm.comm import PendingFloats, allreduce_floats_async
from flexcomm.control.measurements import AgreedSample, Key, agreed_samples, measurement_vector
from flexcomm.control.step_log import LocalSample, sample_from_row, sample_row


@dataclass(frozen=True)
class AgreementPoint:
    """The issued collectives of one agreement point and what is needed to read them back.

    ``expected`` and ``local``: the exchanges every rank planned and this rank's samples of
    them, the measurement vector's layout; ``measurements``: ``None`` when no measurement is
    due; ``gains``: the summed kept energies per candidate and the total, ``None`` when no
    gain curve was measured.
    """

    expected: tuple[Key, ...]
    local: tuple[LocalSample, ...]
    measurements: PendingFloats | None
    gains: PendingFloats | None

    @classmethod
    def issue(cls, expected: Sequence[Key], local: Sequence[LocalSample], periods: Sequence[float] | None,
              gain_energy: Sequence[float] | torch.Tensor | None, group: dist.ProcessGroup | None) -> AgreementPoint:
        """Issue the measurement allreduce (if ``periods`` is given) and then the gain allreduce (if measured)."""
        measurements = None if periods is None else allreduce_floats_async(
            measurement_vector(expected, local, periods), group, dist.ReduceOp.MAX)
        gains = None if gain_energy is None else allreduce_floats_async(gain_energy, group, dist.ReduceOp.SUM)
        return cls(tuple(expected), tuple(local), measurements, gains)

    def measured(self) -> tuple[list[AgreedSample], list[float]] | None:
        """The agreed samples and periods (waits for the allreduce), or ``None`` if none was due."""
        if self.measurements is None:
            return None
        return agreed_samples(self.expected, self.local, self.measurements.values())

    def gain_energy(self) -> list[float] | None:
        """The summed gain curve (waits for the allreduce), or ``None`` if none was measured."""
        return None if self.gains is None else self.gains.values()

    def state_dict(self) -> dict[str, Any]:
        """The agreed values, waiting for them: a resumed run must read what this one would."""
        return {"expected": [list(key) for key in self.expected], "local": [sample_row(s) for s in self.local],
                "measurements": None if self.measurements is None else self.measurements.values(),
                "gains": self.gain_energy()}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> AgreementPoint:
        def restored(values: list[float] | None) -> PendingFloats | None:
            return None if values is None else PendingFloats.completed(values)

        return cls(tuple((int(s), int(b)) for s, b in state["expected"]),
                   tuple(sample_from_row(row) for row in state["local"]),
                   restored(state["measurements"]), restored(state["gains"]))
