"""One allreduce that agrees on the measurements since the last agreement point, of agreed length.

Every rank plans the same buckets at the same steps, so the ``(step, bucket)`` exchanges
entered since the last agreement point -- the *expected* ones -- are the same list on every
rank.  A rank's own samples are not: a step whose exchange never reported leaves none.  So
the collective is laid out over the expected list, never over the local samples: with
``n = len(expected)`` and ``p`` period slots (fixed by the configuration),

    [-service] * n + [-gap] * n + [block] * n + [-present] * n + periods[p]

combined by MAX (``-max(-t) = min t``; ``-max(-present)`` is 1 only if every rank has the
sample).  A rank without a sample sends zeros in its slots; the exchange is then dropped
on every rank alike.  Whether the collective runs depends on the expected list only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch.distributed as dist

from flexcomm.comm import allreduce_floats
from flexcomm.control.step_log import LocalSample

#: An exchange by its step and bucket.
Key = tuple[int, int]


@dataclass(frozen=True)
class AgreedSample:
    """A local sample with the agreed times: service and gap the min over ranks, block the max."""

    sample: LocalSample
    service: float
    gap: float
    block: float


def agree_on_samples(expected: Sequence[Key], local: Sequence[LocalSample], periods: Sequence[float],
                     group: dist.ProcessGroup | None) -> tuple[list[AgreedSample], list[float]]:
    """The samples every rank holds, with agreed times, in ``expected`` order; and the periods' MAX."""
    mine = {(s.step, s.bucket): s for s in local}
    rows = [mine.get(key) for key in expected]
    n = len(rows)
    values = ([-s.service if s else 0.0 for s in rows] + [-s.gap if s else 0.0 for s in rows]
              + [s.block if s else 0.0 for s in rows] + [-1.0 if s else 0.0 for s in rows] + list(periods))
    agreed = allreduce_floats(values, group, dist.ReduceOp.MAX)
    samples = [AgreedSample(s, -agreed[i], -agreed[n + i], agreed[2 * n + i])
               for i, s in enumerate(rows) if agreed[3 * n + i] == -1.0]
    return samples, agreed[4 * n:]
