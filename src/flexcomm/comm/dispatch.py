"""Ordered dispatch: one thread per hook state issues every collective, in bucket order.

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

import queue
import threading
from collections.abc import Callable

import torch

Task = Callable[[], torch.futures.Future]


class Dispatcher:
    """Runs submitted tasks one at a time, in order, on one daemon thread (started on first use)."""

    def __init__(self, name: str = "flexcomm-dispatch") -> None:
        self._name = name
        self._tasks: queue.SimpleQueue[tuple[Task, torch.futures.Future]] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self.failure: BaseException | None = None

    def submit(self, task: Task) -> torch.futures.Future:
        """Queue ``task``; the returned future completes with the value of the future ``task`` returns."""
        result: torch.futures.Future = torch.futures.Future()
        self._ensure_started()
        self._tasks.put((task, result))
        return result

    def _ensure_started(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            task, result = self._tasks.get()
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
