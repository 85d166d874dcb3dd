"""Ordered dispatch: at most one worker thread per hook state issues every collective, in bucket order.

gloo and NCCL pair collectives across ranks by the order in which each rank issues them
on a process group.  A hook that issued its second collective from a ``Future.then``
callback (which runs on whichever backend thread finished the first) would issue them in
an order that differs across ranks once several buckets are in flight: PyTorch's own
PowerSGD hook fails that way on gloo ("Received data size doesn't match expected size").
A hook that waited for the first collective inside the hook would stall backward.

:class:`Dispatcher` does neither.  The hook submits a task per bucket and returns at once
with a future; one thread runs the tasks strictly in submission order (DDP hands buckets
over in the same order on every rank), and each task issues all of its bucket's
collectives -- waiting, on this thread, for a result the next collective needs, such as
AR-Topk's broadcast indices -- before the next task starts.  So every rank issues the
same collectives in the same order, and backward never waits for the network.

Second halves.  An exchange whose second collective needs its first one's result (the
low-rank exchange's ``P`` before its ``Q``) would hold this thread for a round trip, and
every later bucket behind it.  It defers its second half instead (to the dispatcher's
:class:`Deferred`): the hook runs it right after the *next* bucket's collectives were issued,
and a step's last bucket runs every deferred half, its own last.  The collectives then go out as ``F_0, F_1,
S_0, F_2, S_1, ...`` on every rank: the order follows from the bucket order alone, never
from which collective finished first.

Errors: an exception of a task, or of the future it returns, completes that bucket's
future with the exception (DDP re-raises it from backward).  After the first error every
later task fails at once with a message naming it: the ranks are out of step from there
on, and a collective would only wait for its timeout.  A peer that died makes the
pending collective fail within the process group's timeout; nothing here waits longer.

Lifetime: the worker waits :data:`IDLE_TIMEOUT_S` for the next task, so the buckets of a
step (and consecutive steps) share one thread instead of starting one per bucket.  It
ends after that long idle, or once the queue is empty after :meth:`Dispatcher.close`,
which an atexit hook calls for every dispatcher, waiting at most :data:`EXIT_WAIT_S` for it.
"""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from collections import deque
from collections.abc import Callable

import torch

Task = Callable[[], torch.futures.Future]
Half = Callable[[], None]

# How long an idle worker waits for the next task before it ends.  Longer than the gaps
# that should not cost a thread start -- between the buckets of one backward
# (milliseconds) and between steps (forward, optimizer step) -- even on a loaded machine;
# short enough that a state gone quiet (evaluation, a discarded model) frees its thread soon.
IDLE_TIMEOUT_S = 2.0
# How long interpreter exit waits for a worker still inside a task.  A collective whose peer
# died only fails at the process group's timeout (30 min by default): exit gives up sooner,
# and a worker still inside C++ then may abort the process as before (pytorch/pytorch#38228).
EXIT_WAIT_S = 30.0


class Dispatcher:
    """Runs submitted tasks one at a time, in submission order, on a worker thread.

    The worker starts when a task arrives and waits on a condition for the next one.
    Order stays total because a worker decides to end under the lock, on an empty queue,
    and gives up its turn there; a task submitted after that starts the next worker.
    At interpreter exit a daemon thread that comes back from C++ (a collective's wait, a
    tensor op) after finalization began is torn down inside C++ frames, and the process
    aborts with "terminate called without an active exception" (pytorch/pytorch#38228).
    Waiting in a Python-level lock is safe there, but a task is not, so an atexit hook
    closes every dispatcher: no worker is left when finalization begins.
    """

    def __init__(self, name: str = "flexcomm-dispatch", idle_timeout: float = IDLE_TIMEOUT_S) -> None:
        self._name = name
        self._idle_timeout = idle_timeout
        self._tasks: deque[tuple[Task, torch.futures.Future]] = deque()
        self._closed = False
        self._reset_worker()
        self.failure: BaseException | None = None
        #: The exchanges' deferred second halves (used on the worker thread only).
        self.deferred = Deferred()
        _LIVE.add(self)

    def _reset_worker(self) -> None:
        """No worker: also in a forked child, which inherits neither the parent's thread nor its lock's state."""
        self._wake = threading.Condition()
        self._worker: threading.Thread | None = None

    def submit(self, task: Task, devices: list[torch.device] | None = None) -> torch.futures.Future:
        """Queue ``task``; the returned future completes with the value of the future ``task`` returns.

        ``devices``: the CUDA devices of that value, so that a waiter (DDP) synchronises
        its stream with the events recorded when the value is set (none for CPU values).
        """
        result: torch.futures.Future = torch.futures.Future(devices=devices or [])
        with self._wake:
            self._tasks.append((task, result))
            if self._worker is None:
                self._worker = threading.Thread(target=self._drain, name=self._name, daemon=True)
                self._worker.start()
            self._wake.notify()
        return result

    def close(self, timeout: float | None = None) -> None:
        """Let the worker end once the queue is empty, and wait until it has (at most ``timeout`` seconds).

        At interpreter exit a worker still inside a task would come back from C++ during
        finalization (see the class docstring), so the queued tasks are run first.  A
        collective whose peer died fails within the process group's timeout, and every
        later task at once after it.  Later submissions still run, each worker ending on an
        empty queue.
        """
        with self._wake:
            self._closed = True
            self._wake.notify()
            worker = self._worker
        if worker is not None:
            worker.join(timeout)

    def _next(self) -> tuple[Task, torch.futures.Future] | None:
        """The oldest queued task, once one comes; None after giving up the worker's turn."""
        with self._wake:
            self._wake.wait_for(lambda: self._tasks or self._closed, self._idle_timeout)
            if self._tasks:
                return self._tasks.popleft()
            self._worker = None
            return None

    def _drain(self) -> None:
        while self._run_next():
            pass

    def _run_next(self) -> bool:
        """Run the next task; False once the worker gave up its turn.  Its own frame, so that an
        idle worker holds no task, bucket or result."""
        if (queued := self._next()) is None:
            return False
        task, result = queued
        if self.failure is not None:
            # A failure that came in between tasks (an asynchronous collective's) leaves the halves
            # deferred before it unrun: their buckets fail too, or DDP would wait for them.
            fail_halves(self.deferred.take(), self.failure)
            result.set_exception(RuntimeError(f"flexcomm: an earlier exchange failed, so this one was not started: {self.failure!r}"))
            return True
        try:
            issued = task()
        except BaseException as err:  # noqa: BLE001 - every error goes to the bucket's future
            # Halves still deferred (the task failed before it took them, e.g. entering the
            # exchange's CUDA context) will not run: their buckets fail with it.
            fail_halves(self.deferred.take(), err)
            self._fail(err, result)
            return True
        issued.add_done_callback(lambda fut, result=result: self._forward(fut, result))
        return True

    def _forward(self, issued: torch.futures.Future, result: torch.futures.Future) -> None:
        try:
            value = issued.value()
        except BaseException as err:  # noqa: BLE001
            self._fail(err, result)
            return
        result.set_result(value)

    def _fail(self, err: BaseException, result: torch.futures.Future) -> None:
        if self.failure is None:
            self.failure = err
        result.set_exception(err)


class Deferred:
    """The second halves deferred by a step's exchanges, in bucket order (see the module docstring).

    Each half comes with its bucket's future: the half completes it (with the half's exception if
    it raises), and :func:`fail_halves` fails it where the half will never run.
    """

    def __init__(self) -> None:
        self._halves: list[tuple[Half, torch.futures.Future]] = []

    def defer(self, half: Half, result: torch.futures.Future) -> None:
        self._halves.append((half, result))

    def take(self) -> list[tuple[Half, torch.futures.Future]]:
        """The halves deferred so far, oldest first; none are left."""
        halves, self._halves = self._halves, []
        return halves


def run_halves(halves: list[tuple[Half, torch.futures.Future]]) -> None:
    """Run every half in order, then raise the first one's error: a failed half has failed its own bucket,
    and the ranks are out of step from there on, but the later halves' buckets must not wait forever."""
    failure: BaseException | None = None
    for half, _ in halves:
        try:
            half()
        except BaseException as err:  # noqa: BLE001 - re-raised below, after the others ran
            failure = failure or err
    if failure is not None:
        raise failure


def fail_halves(halves: list[tuple[Half, torch.futures.Future]], err: BaseException) -> None:
    """Fail the buckets of halves that will not run (a later bucket's exchange failed: the ranks are out of
    step, and a half's collective would only wait for its timeout), so that DDP raises instead of waiting."""
    for _, result in halves:
        if not result.done():
            result.set_exception(RuntimeError(f"flexcomm: a later bucket's exchange failed before this one finished: {err!r}"))


def forward_to(result: torch.futures.Future) -> Callable[[torch.futures.Future], None]:
    """A done-callback that completes ``result`` with the finished future's value or error."""

    def forward(issued: torch.futures.Future) -> None:
        try:
            value = issued.value()
        except BaseException as err:  # noqa: BLE001 - the error goes to result
            result.set_exception(err)
            return
        result.set_result(value)

    return forward


# Every dispatcher, weakly: one with a worker stays alive through the worker's reference.
_LIVE: weakref.WeakSet[Dispatcher] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    """At interpreter exit (after non-daemon threads were joined, before finalization)."""
    for dispatcher in list(_LIVE):
        dispatcher.close(EXIT_WAIT_S)


def _reset_in_child() -> None:
    for dispatcher in list(_LIVE):
        dispatcher._reset_worker()


if hasattr(os, "register_at_fork"):  # POSIX only
    os.register_at_fork(after_in_child=_reset_in_child)
