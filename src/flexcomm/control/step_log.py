"""One rank's timeline of a step, turned into the step-cost model's samples.

Per step the planner notes when each bucket's hook was called (``entered``) and, as each
exchange finishes, its collective's duration and the time it finished.  At the next
step's first bucket (no exchange in flight) :meth:`StepLog.close` turns that into one
:class:`LocalSample` per bucket:

* ``service``: the collective's own time.  A collective launched while another still ran
  waited for it or shared the link with it (gloo runs a few at once): collectives whose
  ``[launched, done]`` intervals overlap form one busy period, from its first launch to its
  last completion, split among them by bytes; a lone collective's is its own duration.  (A
  raw launch-to-done time counts the wait, and made dense look slower the more buckets
  queued behind each other; periods formed in completion order gave a dense allreduce that
  finished after the small collectives launched meanwhile only the time after them: 70 ms
  for 210 ms of 1 Gbit wire time, and flex kept that bucket dense.)
* ``block``: this rank's local work of the exchange (0 for dense);
* ``gap``: the backward compute after the bucket's hook call until the next bucket's,
  ``entered[next] - entered[b] - block[b]`` (0 for the step's last bucket);
* ``kept``: ``gain^2``, the energy fraction of its accumulated gradient this rank sent (NaN
  until the step's outcomes are settled, and for dense exchanges);
* ``quality``: ``cos(update, mean gradient)`` on a shared sample of coordinates (NaN where not
  measured: only the low-rank exchange measures it).

Local samples differ across ranks; the planner agrees on them (min of ``service`` and
``gap`` -- the rank that arrived last waited for nobody, the leader of an AR-Topk exchange
did not wait for its own selection -- max of ``block``, which every rank waits for; min and
max of ``kept``).  ``quality`` needs no agreement: every rank computes it from the same
allreduced values.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from time import perf_counter
from typing import Any

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
    kept: float = math.nan
    quality: float = math.nan


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
    kept: float = math.nan
    quality: float = math.nan


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

    def sent(self, step: int, bucket: int, gain: float) -> None:
        """A bucket's settled gain ``||sent|| / ||accumulated||`` on this rank."""
        entry = self._entries.get(bucket) if self._step == step else None
        if entry is not None:
            entry.kept = gain * gain

    def measured_quality(self, step: int, bucket: int, quality: float) -> None:
        """A bucket's settled ``cos(update, mean gradient)`` on a sample (the same value on every rank)."""
        entry = self._entries.get(bucket) if self._step == step else None
        if entry is not None:
            entry.quality = quality

    def exchanges(self) -> dict[int, tuple[str, float]]:
        """bucket -> (exchange, density) of every exchange entered this step: the same on every rank."""
        return {b: (e.exchange, e.density) for b, e in self._entries.items()} if self._step is not None else {}

    def keys(self) -> list[tuple[int, int]]:
        """``(step, bucket)`` of every exchange entered this step: the same list on every rank."""
        return sorted((self._step, b) for b in self._entries) if self._step is not None else []

    def state_dict(self) -> dict[str, Any]:
        """The open step's entries, times as ages (seconds before now): a clock does not survive a restart."""
        now = perf_counter()
        return {"step": self._step, "entries": [
            [e.bucket, e.exchange, e.density, e.numel, e.value_bytes, e.predicted, now - e.entered,
             None if e.observation is None else list(e.observation), e.block, now - e.done, e.kept, e.quality]
            for e in self._entries.values()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        now = perf_counter()
        self._step = state["step"]
        self._entries = {}
        for row in state["entries"]:
            bucket, exchange, density, numel, vb, predicted, entered, observation, block, done, *measured = row
            self._entries[bucket] = _Entry(bucket, exchange, density, numel, vb, predicted, now - entered,
                                           None if observation is None else Observation(*observation), block, now - done,
                                           *measured)  # absent from states saved before they were kept

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
                                       e.block, service[e.bucket], gap, e.predicted, e.kept, e.quality))
        return samples


def _service_times(entries: list[_Entry]) -> dict[int, float]:
    """Each collective's own time: busy periods of the group split among the collectives in them.

    A collective occupies ``[done - seconds, done]``.  Overlapping intervals form one busy
    period (gloo runs a few collectives at once, sharing the link; a queued one waits for
    the one before), from its first launch to its last completion, split in proportion to
    the collectives' bytes.  A long allreduce launched first and finished last spans the
    small collectives launched meanwhile: one period, almost all of it the allreduce's.
    """
    def launched(e: _Entry) -> float:
        return e.done - e.observation.seconds

    periods: list[list[_Entry]] = []
    end = float("-inf")
    for e in sorted(entries, key=launched):
        if periods and launched(e) < end:
            periods[-1].append(e)
        else:
            periods.append([e])
        end = max(end, e.done)
    service: dict[int, float] = {}
    for period in periods:
        busy = max(e.done for e in period) - launched(period[0])
        total = sum(e.observation.nbytes for e in period)
        for e in period:
            service[e.bucket] = busy * (e.observation.nbytes / total if total else 1.0 / len(period))
    return service


def sample_row(sample: LocalSample) -> list[Any]:
    """A sample as plain values (checkpoints load with ``weights_only=True``)."""
    row = list(astuple(sample))
    row[6] = list(sample.observation)
    return row


def sample_from_row(row: Sequence[Any]) -> LocalSample:
    values = list(row)
    values[6] = Observation(*values[6])
    return LocalSample(*values)
