"""Where the hook's device work runs, and what it waits for: CUDA streams and events.

On a CPU every function here is a no-op: tensor work is synchronous.  On a GPU the
hook's work crosses three threads and several streams:

* DDP calls the hook on the autograd thread, whose current stream produced the bucket
  (the default stream, or the user's own under ``torch.cuda.stream(s)``).
  :func:`mark_ready` records an event there, so the bucket is read only once written.
* The dispatcher thread runs the bucket's local work and launches its collectives.  A
  new thread's current CUDA device is device 0, whatever the autograd thread set, so
  :func:`exchange_context` sets the bucket's device first (else every rank's control
  tensors would land on GPU 0), then moves onto a stream of the hook's own that waits
  on the ready event; selection then does not serialise with the rest of backward.
* A collective's ``then`` callbacks run on streams that waited for the collective.  A
  tensor allocated on the exchange stream and used there must be marked with
  :func:`used_on_current_stream`, or the caching allocator could hand its memory to the
  exchange stream's next allocation while the callback's kernels still read it.

The futures handed to DDP carry their devices (:func:`future_devices`): DDP's wait then
makes its stream wait for the events the future recorded when its value was set.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


def future_devices(tensor: torch.Tensor) -> list[torch.device]:
    """The devices a future holding ``tensor`` must synchronise (none for a CPU tensor)."""
    return [tensor.device] if tensor.device.type == "cuda" else []


def mark_ready(tensor: torch.Tensor) -> torch.cuda.Event | None:
    """An event recorded on the current stream of ``tensor``'s device (CUDA), else None.

    Call it on the thread that produced ``tensor``, before handing it to another thread.
    """
    if tensor.device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


class ExchangeStreams:
    """One CUDA stream per device for the hook's work, made on first use."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


@contextmanager
def exchange_context(device: torch.device, ready: torch.cuda.Event | None, streams: ExchangeStreams) -> Iterator[None]:
    """Run the enclosed work on ``device``'s exchange stream, after ``ready`` (CUDA); nothing on a CPU."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.set_device(device)
    stream = streams.stream(device)
    if ready is not None:
        stream.wait_event(ready)
    with torch.cuda.stream(stream):
        yield


def used_on_current_stream(*tensors: torch.Tensor) -> None:
    """Tell the caching allocator that the current stream uses ``tensors`` (CUDA; no-op on a CPU)."""
    for tensor in tensors:
        if tensor.device.type == "cuda":
            tensor.record_stream(torch.cuda.current_stream(tensor.device))
