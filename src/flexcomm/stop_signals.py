"""How a launcher turns SIGINT and SIGTERM into exceptions, so that its ranks are stopped.

:func:`flexcomm.launch.run_ranks` runs its ranks inside :func:`signals_stop_ranks`; a
signal then unwinds it through the code that stops every rank, and one that lands while
ranks are being started waits until they are all known (:meth:`StopSignals.deferred`).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


class StopSignals:
    """SIGINT as KeyboardInterrupt, SIGTERM as SystemExit(143); held back while ranks start.

    A signal that lands while :func:`flexcomm.launch.start_ranks` is half way (a process started, its
    readers not yet) would leave that rank out of the list the launcher stops, alive after
    the launcher is gone: inside :meth:`deferred` it is raised only once the block is done.
    """

    def __init__(self) -> None:
        self._deferring = False
        self._pending: int | None = None

    def handle(self, signum: int, frame: object) -> None:
        if self._deferring:
            self._pending = signum
            return
        _raise_for(signum)

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        self._deferring = True
        try:
            yield
        finally:
            self._deferring = False
        if self._pending is not None:
            signum, self._pending = self._pending, None
            _raise_for(signum)


def _raise_for(signum: int) -> None:
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


@contextlib.contextmanager
def signals_stop_ranks() -> Iterator[StopSignals]:
    """While ranks run, SIGINT and SIGTERM raise (see :class:`StopSignals`; main thread only).

    Also where SIGINT was ignored (a shell's background job): else the ranks would outlive a kill.
    """
    signals = StopSignals()
    if threading.current_thread() is not threading.main_thread():
        yield signals
        return
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, signals.handle)
    try:
        yield signals
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
