"""Timing device work: the host clock on a CPU, CUDA events on a GPU.

A host clock around an asynchronous CUDA call measures its launch (microseconds,
whatever the size), not the work: the cost model would see a free network.  So on a GPU
a time mark is a CUDA event recorded on the current stream, and a span between two
marks is read only once the later event has completed -- one step later, when the state
settles the step, never inside the exchange.  On a CPU a mark is ``perf_counter()`` and
a span can be read at once.
"""

from __future__ import annotations

from time import perf_counter
from typing import Union

import torch

Mark = Union[float, torch.cuda.Event]


def now(device: torch.device) -> Mark:
    """A time mark on ``device``: a recorded CUDA event, or the host clock for a CPU device."""
    if device.type != "cuda":
        return perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return event


def readable_now(start: Mark) -> bool:
    """Whether spans from ``start`` can be read at once (host marks) or only at settle (events)."""
    return isinstance(start, float)


def seconds(start: Mark, end: Mark) -> float:
    """Seconds from ``start`` to ``end``; for events, waits for ``end`` (done by settle time anyway)."""
    if isinstance(start, float) and isinstance(end, float):
        return end - start
    assert isinstance(start, torch.cuda.Event) and isinstance(end, torch.cuda.Event)
    end.synchronize()
    return start.elapsed_time(end) / 1000.0
