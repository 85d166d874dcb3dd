"""Walk a bandwidth schedule in a background thread while a job runs."""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import NamedTuple, Protocol

from .schedule import Phase

__all__ = ["PausableClock", "RateSetter", "RateChange", "ScheduleRunner"]

log = logging.getLogger("flexcomm.netem")


class RateSetter(Protocol):
    """Anything whose link rate can be changed (EmulatedCluster, or a fake in tests).

    ``ScheduleRunner`` passes ``jitter_s=`` as a keyword only when some phase
    of its schedule has jitter, so two-argument setters keep working.
    """

    def set_rate(self, rate_bps: float, delay_s: float | None = None) -> None: ...


class RateChange(NamedTuple):
    """One applied change: ``time_s`` is seconds since the runner started.

    Add ``ScheduleRunner.start_wall`` to ``time_s`` to line changes up with
    wall-clock training logs.
    """

    time_s: float
    rate_bps: float
    delay_s: float
    jitter_s: float = 0.0


#: How often a runner whose schedule can pause re-reads its clock (the pause's resolution).
PAUSE_POLL_S = 0.005


class PausableClock:
    """A clock that stands still while ``paused()`` holds: phases last that long in unpaused time.

    The pause is seen when the clock is read, so it is as exact as the readings are frequent
    (a runner with a pausable clock reads it every :data:`PAUSE_POLL_S`).
    """

    def __init__(self, clock: Callable[[], float], paused: Callable[[], bool]) -> None:
        self._clock, self._paused = clock, paused
        self._stopped_at: float | None = None
        self._offset = 0.0

    def __call__(self) -> float:
        now = self._clock()
        if self._paused():
            if self._stopped_at is None:
                self._stopped_at = now
            return self._stopped_at - self._offset
        if self._stopped_at is not None:
            self._offset += now - self._stopped_at
            self._stopped_at = None
        return now - self._offset


class ScheduleRunner:
    """Apply each phase of a schedule at its boundary, in a daemon thread.

    With ``paused``, the schedule's clock stands still while ``paused()`` holds (a training
    job's evaluations: the link changes on training time, and evaluating more often does not
    move training into later phases); :attr:`changes` then carry that clock's times.

    The first phase is applied as soon as the runner starts (so the runner is
    the single source of truth for the log of changes); the last phase stays in
    force until :meth:`stop`. Stopping never blocks for a whole phase: the
    thread sleeps on an Event. An exception from ``set_rate`` ends the thread
    and is kept in :attr:`error` (and re-raised by :meth:`stop`), because a
    silently stuck rate would invalidate the experiment.

    Usable as a context manager: ``with ScheduleRunner(cluster, phases): ...``.
    """

    def __init__(
        self,
        target: RateSetter,
        phases: list[Phase],
        clock: Callable[[], float] = time.monotonic,
        on_change: Callable[[RateChange], None] | None = None,
        paused: Callable[[], bool] | None = None,
    ) -> None:
        self.target = target
        self.phases = list(phases)
        self.changes: list[RateChange] = []
        self.error: BaseException | None = None
        self.start_wall: float | None = None
        self._clock = clock if paused is None else PausableClock(clock, paused)
        self._poll = math.inf if paused is None else PAUSE_POLL_S
        self._on_change = on_change
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = 0.0
        # Only schedules that use jitter pass it on (and then in every phase, so it can return to 0).
        self._pass_jitter = any(p.jitter_s > 0 for p in self.phases)

    def start(self) -> ScheduleRunner:
        """Start walking the schedule; returns self for chaining."""
        if self._thread is not None:
            raise RuntimeError("ScheduleRunner already started")
        self._t0 = self._clock()
        self.start_wall = time.time()
        self._thread = threading.Thread(target=self._run, name="flexcomm-netem-schedule", daemon=True)
        self._thread.start()
        return self

    def _apply(self, phase: Phase) -> None:
        """Set the phase's rate and record when it took effect."""
        if self._pass_jitter:
            self.target.set_rate(phase.rate_bps, phase.delay_s, jitter_s=phase.jitter_s)  # type: ignore[call-arg]
        else:
            self.target.set_rate(phase.rate_bps, phase.delay_s)
        change = RateChange(self._clock() - self._t0, phase.rate_bps, phase.delay_s, phase.jitter_s)
        self.changes.append(change)
        log.info(
            "netem: rate -> %.3g bit/s (delay %.3g s, jitter %.3g s) at t=%.3f s",
            change.rate_bps,
            change.delay_s,
            change.jitter_s,
            change.time_s,
        )
        if self._on_change is not None:
            self._on_change(change)

    def _run(self) -> None:
        """Thread body: apply phases at absolute boundaries so drift does not accumulate."""
        try:
            boundary = 0.0
            for phase in self.phases:
                while (wait := self._t0 + boundary - self._clock()) > 0:
                    if self._stop.wait(min(wait, self._poll)):
                        return
                if self._stop.is_set():
                    return
                self._apply(phase)
                if phase.duration_s is None:
                    return
                boundary += phase.duration_s
        except BaseException as exc:  # noqa: BLE001 - kept and re-raised in stop()
            self.error = exc
            log.error("netem schedule stopped: %s", exc)

    @property
    def running(self) -> bool:
        """True while the thread still has phases to apply."""
        return self._thread is not None and self._thread.is_alive()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until all phases are applied (or timeout); True if finished."""
        if self._thread is None:
            return True
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self, timeout: float = 10.0, raise_error: bool = True) -> None:
        """Stop the thread (idempotent); re-raise any error from ``set_rate``."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout)
        if raise_error and self.error is not None:
            error, self.error = self.error, None
            raise RuntimeError(f"bandwidth schedule failed: {error}") from error

    def __enter__(self) -> ScheduleRunner:
        return self.start() if self._thread is None else self

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Do not mask an exception already propagating out of the block.
        self.stop(raise_error=exc_type is None)
