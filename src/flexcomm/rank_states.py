"""Every rank's hook state in one checkpoint file, and each rank's own back out of it.

Frameworks that write one checkpoint file from rank 0 (Lightning, Accelerate) would
otherwise save only rank 0's :class:`~flexcomm.FlexState`, and a resumed job would give
every rank rank 0's error-feedback residuals.  The residuals differ per rank (each rank
keeps what its own gradient did not send), so the integrations gather all ranks'
``state_dict()`` into the file and, on loading, hand rank ``r`` entry ``r``.

The gather runs over a CPU (gloo) group: over NCCL, ``gather_object`` would stage every
rank's pickled residuals in rank 0's GPU memory at once.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from flexcomm import FlexState, elastic

#: Where the integrations put the list of per-rank states in a checkpoint.
CHECKPOINT_KEY = "flexcomm_rank_states"


def gather_rank_states(state: FlexState, dst: int = 0) -> list[dict[str, Any]] | None:
    """``[rank 0's state_dict(), rank 1's, ...]`` on rank ``dst``, ``None`` on the others.

    A collective over the default process group: every rank must call it, in the same
    order as its other collectives.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    gathered: list[Any] | None = [None] * world_size if rank == dst else None
    dist.gather_object(state.state_dict(), gathered, dst=dst, group=_cpu_group())
    return gathered


# The gloo group made for a default group without a CPU backend, per default group.
_CPU_GROUPS: dict[int, dist.ProcessGroup] = {}


def _cpu_group() -> dist.ProcessGroup | None:
    """A group of every rank that carries CPU tensors: the default group if it can, else one made once.

    Made by every rank at its first checkpoint, the same point on all of them.
    """
    if has_cpu_backend(dist.get_backend()):
        return None
    world = dist.group.WORLD
    if id(world) not in _CPU_GROUPS:
        _CPU_GROUPS[id(world)] = dist.new_group(backend="gloo")
    return _CPU_GROUPS[id(world)]


def has_cpu_backend(backend: str) -> bool:
    """Whether a group of ``backend`` (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``, ...) takes CPU tensors."""
    return backend == "gloo" or "cpu:" in backend


def load_own_rank_state(state: FlexState, rank_states: list[dict[str, Any]], residuals: str = "fold") -> None:
    """Load this rank's entry of :func:`gather_rank_states`'s list into ``state``.

    A list of another length (saved by N ranks, this job has M) loads under the policy of
    :mod:`flexcomm.elastic`: a remaining rank takes its own entry and, with
    ``residuals="fold"``, folds in the departed ranks ``rank + M, rank + 2M, ...``; a new
    rank takes entry 0's step and controller and starts with zero residuals.
    """
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if not isinstance(rank_states, list) or not rank_states:
        raise ValueError("the checkpoint's flexcomm hook states must be a non-empty list, one state per saved rank")
    if len(rank_states) == world_size:
        state.load_state_dict(rank_states[rank])
        return
    own, departed = elastic.sources(rank, world_size, len(rank_states))
    folded = [rank_states[j] for j in departed] if residuals == "fold" else []
    state.load_state_dict(rank_states[own], departed_states=folded, residuals=residuals)
