"""The collectives flexcomm exchanges gradients with, over a torch.distributed group.

Each function launches exactly one collective.  The ones whose result is needed before
anything else can happen (the AR-Topk index broadcast) block -- they are called only on
the hook's dispatcher thread (:mod:`flexcomm.comm.dispatch`), never on the autograd
thread; the others return a ``torch.futures.Future`` so that DDP can overlap them with
the rest of backward.  Nothing here waits inside a future's callback: with gloo,
callbacks run on the process group's worker threads, and a collective awaited there can
starve the pool.

Control tensors (probes, agreements) live on :func:`control_device`: the current CUDA
device when the group's backend is NCCL (which rejects CPU tensors), the CPU otherwise
(gloo, or a group with a CPU backend beside NCCL).  On the dispatcher thread the current
device is the bucket's: :func:`flexcomm.comm.streams.exchange_context` sets it.

A result read in a ``then`` callback is marked as used on the callback's stream (see
:func:`~flexcomm.comm.streams.used_on_current_stream`): it was allocated on the
exchange stream, and the callback's kernels run on another.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from flexcomm.comm.streams import used_on_current_stream


def control_device(group: dist.ProcessGroup | None) -> torch.device:
    """Where the small control tensors of ``group``'s collectives must live (see the module docstring)."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def allreduce_sum(tensor: torch.Tensor, group: dist.ProcessGroup | None) -> torch.futures.Future:
    """Sum ``tensor`` in place across ranks; the future's value is ``tensor``."""
    work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)
    return work.get_future().then(_resolving_to(tensor))


def allgather(message: torch.Tensor, group: dist.ProcessGroup | None) -> torch.futures.Future:
    """Concatenate every rank's equally sized flat ``message``; the value is the concatenation."""
    gathered = message.new_empty(message.numel() * dist.get_world_size(group))
    # torch 2.13 deprecates all_gather_into_tensor for all_gather_single (the same
    # collective); torch 2.4 has only the former.
    gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather_into(gathered, message, group=group, async_op=True)
    return work.get_future().then(_resolving_to(gathered))


def broadcast_from(tensor: torch.Tensor, src_group_rank: int, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Blocking broadcast of ``tensor`` from group rank ``src_group_rank``, in place."""
    src = src_group_rank if group is None else dist.get_global_rank(group, src_group_rank)
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def _resolving_to(result: torch.Tensor) -> Callable[[torch.futures.Future], torch.Tensor]:
    """A ``then`` callback whose value is ``result``, re-raising the collective's error.

    A callback that never reads its future turns a failed or timed-out collective into a
    success with un-reduced data; ``fut.value()`` raises the error instead.
    """

    def resolve(fut: torch.futures.Future) -> torch.Tensor:
        fut.value()
        used_on_current_stream(result)
        return result

    return resolve
