"""One rank's timeline of a step, turned into the step-cost model's samples.

Per step the planner notes when each bucket's hook was called (``entered``) and, as each
exchange finishes, its collective's duration and the time it finished.  At the next
step's first bucket (no exchange in flight) :meth:`StepLog.close` turns that into one
:class:`LocalSample` per bucket:

* ``service``: the collective's own time.  A collective launched while the previous one
  still ran waited for it or shared the link with it (gloo runs a few at once): in
  completion order, overlapping collectives form one busy period, from its first launch
  (or the previous period's end) to its last completion, split among them by bytes; a
  lone collective's is ``done - max(launched, previous done)``.  (A raw launch-to-done time
  counts the wait, and made dense look slower the more buckets queued behind each other.)
* ``block``: this rank's local work of the exchange (0 for dense);
* ``gap``: the backward compute after the bucket's hook call until the next bucket's,
  ``entered[next] - entered[b] - block[b]`` (0 for the step's last bucket).

Local samples differ across ranks; the planner agrees on them (min of ``service`` and
``gap`` -- the rank that arrived last waited for nobody, the leader of an AR-Topk exchange
did not wait for its own selection -- max of ``block``, which every rank waits for).
"""

from __future__ import annotations

from dataclasses import dataclass
from time import perf_counter

from flexcomm.cost import Observation


@dataclass(frozen=True)
class LocalSample:
    """One bucket exchange of one step as this rank saw it, with the prediction made when it was planned."""

    step: int
    bucket: int
    exchange: str
    density: float
    numel: int
    value_bytes: int
    observation: Observation
    block: float
    service: float
    gap: float
    predicted: float


@dataclass
class _Entry:
    bucket: int
    exchange: str
    density: float
    numel: int
    value_bytes: int
    predicted: float
    entered: float
    observation: Observation | None = None
    block: float = 0.0
    done: float = 0.0


class StepLog:
    """Hook calls and finished exchanges of the current step on this rank."""

    def __init__(self) -> None:
        self._step: int | None = None
        self._entries: dict[int, _Entry] = {}

    def entered(self, step: int, bucket: int, exchange: str, density: float, numel: int, value_bytes: int,
                predicted: float) -> None:
        """A bucket's hook was called (stamped now) and planned as ``exchange`` at ``density``."""
        if self._step != step:
            self._step, self._entries = step, {}
        self._entries[bucket] = _Entry(bucket, exchange, density, numel, value_bytes, predicted, perf_counter())

    def finished(self, step: int, bucket: int, observation: Observation, block: float) -> None:
        """A bucket's exchange finished (stamped now): its collective's sample and local work."""
        entry = self._entries.get(bucket) if self._step == step else None
        if entry is not None:
            entry.observation, entry.block, entry.done = observation, block, perf_counter()

    def close(self) -> list[LocalSample]:
        """The finished step's samples, in hook order; the log starts over."""
        entries = sorted(self._entries.values(), key=lambda e: e.entered)
        step, self._step, self._entries = self._step, None, {}
        if step is None or any(e.observation is None for e in entries):
            return []  # an exchange that never reported (a failed step): no samples
        service = _service_times(entries)
        samples = []
        for e, following in zip(entries, entries[1:] + [None]):
            gap = 0.0 if following is None else max(0.0, following.entered - e.entered - e.block)
            samples.append(LocalSample(step, e.bucket, e.exchange, e.density, e.numel, e.value_bytes, e.observation,
                                       e.block, service[e.bucket], gap, e.predicted))
        return samples


def _service_times(entries: list[_Entry]) -> dict[int, float]:
    """Each collective's own time: busy periods of the group split among the collectives in them.

    In completion order, a collective launched before the previous one finished shares a
    busy period with it (gloo runs a few collectives at once, sharing the link); a busy
    period lasts from its first launch (or the previous period's end) to its last
    completion and is split in proportion to the collectives' bytes.
    """
    periods: list[list[_Entry]] = []
    for e in sorted(entries, key=lambda e: e.done):
        if periods and e.done - e.observation.seconds < periods[-1][-1].done:
            periods[-1].append(e)
        else:
            periods.append([e])
    service: dict[int, float] = {}
    previous_end = float("-inf")
    for period in periods:
        start = max(min(e.done - e.observation.seconds for e in period), previous_end)
        busy, total = period[-1].done - start, sum(e.observation.nbytes for e in period)
        for e in period:
            service[e.bucket] = busy * (e.observation.nbytes / total if total else 1.0 / len(period))
        previous_end = period[-1].done
    return service
