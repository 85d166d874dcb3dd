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

Errors: an exception of a task, or of the future it returns, completes that bucket's
future with the exception (DDP re-raises it from backward).  After the first error every
later task fails at once with a message naming it: the ranks are out of step from there
on, and a collective would only wait for its timeout.  A peer that died makes the
pending collective fail within the process group's timeout; nothing here waits longer.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

import torch

Task = Callable[[], torch.futures.Future]


class Dispatcher:
    """Runs submitted tasks one at a time, in submission order, on a worker thread.

    The worker starts when a task arrives and ends as soon as the queue is empty, so no
    thread outlives the step's last bucket.  A thread left waiting at interpreter exit is
    not harmless: a daemon thread that comes back from C++ (a collective's wait, a
    tensor op) after finalization began is torn down inside C++ frames, and the process
    aborts with "terminate called without an active exception" (pytorch/pytorch#38228).
    Order stays total because a new worker starts only after the previous one has, under
    the lock, found the queue empty and given up its turn.
    """

    def __init__(self, name: str = "flexcomm-dispatch") -> None:
        self._name = name
        self._tasks: deque[tuple[Task, torch.futures.Future]] = deque()
        self._lock = threading.Lock()
        self._running = False
        self.failure: BaseException | None = None

    def submit(self, task: Task, devices: list[torch.device] | None = None) -> torch.futures.Future:
        """Queue ``task``; the returned future completes with the value of the future ``task`` returns.

        ``devices``: the CUDA devices of that value, so that a waiter (DDP) synchronises
        its stream with the events recorded when the value is set (none for CPU values).
        """
        result: torch.futures.Future = torch.futures.Future(devices=devices or [])
        with self._lock:
            self._tasks.append((task, result))
            if not self._running:
                self._running = True
                threading.Thread(target=self._drain, name=self._name, daemon=True).start()
        return result

    def _next(self) -> tuple[Task, torch.futures.Future] | None:
        """The oldest queued task, or None after giving up the worker's turn on an empty queue."""
        with self._lock:
            if self._tasks:
                return self._tasks.popleft()
            self._running = False
            return None

    def _drain(self) -> None:
        while (queued := self._next()) is not None:
            task, result = queued
            if self.failure is not None:
                result.set_exception(RuntimeError(f"flexcomm: an earlier exchange failed, so this one was not started: {self.failure!r}"))
                continue
            try:
                issued = task()
            except BaseException as err:  # noqa: BLE001 - every error goes to the bucket's future
                self._fail(err, result)
                continue
            issued.add_done_callback(lambda fut, result=result: self._forward(fut, result))

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
