"""The layout of the allreduce that agrees on the measurements since the last agreement point.

Every rank plans the same buckets at the same steps, so the ``(step, bucket)`` exchanges
closed since the last agreement point -- the *expected* ones -- are the same list on every
rank.  A rank's own samples are not: a step whose exchange never reported leaves none.  So
the collective is laid out over the expected list, never over the local samples: with
``n = len(expected)`` and ``p`` period slots (fixed by the configuration),

    [-service] * n + [-gap] * n + [block] * n + [-present] * n + [-kept] * n + [kept] * n + periods[p]

combined by MAX (``-max(-t) = min t``; ``-max(-present)`` is 1 only if every rank has the
sample).  A rank without a sample sends zeros in its slots; the exchange is then dropped
on every rank alike.  ``kept`` (the energy fraction sent) is positive when known: a rank
that does not know it sends 0, and the agreed minimum, 0, says "unknown" on every rank.  Whether the collective runs depends on the expected list only.
:mod:`flexcomm.control.agreement_point` issues it; :func:`measurement_vector` and
:func:`agreed_samples` are its two ends.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from flexcomm.control.step_log import LocalSample

#: An exchange by its step and bucket.
Key = tuple[int, int]


@dataclass(frozen=True)
class StepSample:
    """One bucket exchange of one step at ``density``, agreed across ranks."""

    bucket: int
    exchange: str
    density: float
    block: float
    comm: float
    gap: float
    #: Smallest and largest energy fraction sent over ranks (NaN: unknown); see :mod:`flexcomm.control.quality`.
    kept_min: float = math.nan
    kept_max: float = math.nan
    #: ``cos(update, mean gradient)`` on a sample, the same on every rank (NaN: not measured).
    quality: float = math.nan


@dataclass(frozen=True)
class AgreedSample:
    """A local sample with the agreed times: service and gap the min over ranks, block the max;
    the smallest and largest energy fraction kept over ranks (NaN: some rank does not know it)."""

    sample: LocalSample
    service: float
    gap: float
    block: float
    kept_min: float = math.nan
    kept_max: float = math.nan

    def step_sample(self) -> StepSample:
        """What the exchange chooser learns from: the exchange with its agreed times, energies and quality."""
        s = self.sample
        return StepSample(s.bucket, s.exchange, s.density, self.block, self.service, self.gap,
                          self.kept_min, self.kept_max, s.quality)


def measurement_vector(expected: Sequence[Key], local: Sequence[LocalSample], periods: Sequence[float]) -> list[float]:
    """This rank's slots of the MAX allreduce, laid out over ``expected``; ``len(expected) * 6 + len(periods)`` long."""
    rows = _rows(expected, local)
    kept = [s.kept if s and math.isfinite(s.kept) and s.kept > 0.0 else 0.0 for s in rows]
    return ([-s.service if s else 0.0 for s in rows] + [-s.gap if s else 0.0 for s in rows]
            + [s.block if s else 0.0 for s in rows] + [-1.0 if s else 0.0 for s in rows]
            + [-k for k in kept] + kept + list(periods))


def agreed_samples(expected: Sequence[Key], local: Sequence[LocalSample],
                   agreed: Sequence[float]) -> tuple[list[AgreedSample], list[float]]:
    """From the combined vector: the samples every rank holds, with agreed times, in ``expected`` order; the periods."""
    rows = _rows(expected, local)
    n = len(rows)
    def known(value: float) -> float:
        return value if value > 0.0 else math.nan

    samples = [AgreedSample(s, -agreed[i], -agreed[n + i], agreed[2 * n + i],
                            known(-agreed[4 * n + i]), known(agreed[5 * n + i]))
               for i, s in enumerate(rows) if s is not None and agreed[3 * n + i] == -1.0]
    return samples, list(agreed[6 * n:])


def _rows(expected: Sequence[Key], local: Sequence[LocalSample]) -> list[LocalSample | None]:
    mine = {(s.step, s.bucket): s for s in local}
    return [mine.get(key) for key in expected]
