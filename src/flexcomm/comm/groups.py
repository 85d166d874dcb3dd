"""A process group of flexcomm's own, with the same ranks as DDP's.

gloo and NCCL pair the collectives of a group by the order in which each rank issues
them.  flexcomm issues its collectives from its dispatcher thread, in bucket order.  Others
issue collectives on DDP's group from other threads at the same time: DDP itself (with
``find_unused_parameters=True`` or ``static_graph=True`` it allreduces the map of used
parameters from the autograd thread right after the last bucket's hook), a second DDP
model in the same backward pass, or the training script.  On a shared group the two
orders interleave differently on different ranks, and gloo fails with "Received data size
doesn't match expected size" (or hangs).  On a group of its own the dispatcher's order is
the only one.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

from flexcomm.comm.collectives import control_device


def own_group(group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    """A new group of ``group``'s ranks (default: every rank), its backend and its timeout.

    Every member must call this at the same point (as it constructs DDP).  A group of all
    ranks is created the usual way; a subgroup only by its members
    (``use_local_synchronization``), since other ranks may be creating their own subgroup
    at the same moment.
    """
    group = group or dist.group.WORLD
    ranks = dist.get_process_group_ranks(group)
    options = {"backend": dist.get_backend(group), "timeout": _timeout(group)}
    if len(ranks) == dist.get_world_size():
        return dist.new_group(ranks, **options)
    return dist.new_group(ranks, use_local_synchronization=True, **options)


def _timeout(group: dist.ProcessGroup) -> timedelta | None:
    """``group``'s collective timeout, so that a dead peer is detected as soon as on DDP's group.

    torch has no public getter; where its backend object lacks the option (other torch
    versions), None: the backend's default.
    """
    try:
        return group._get_backend(control_device(group)).options._timeout
    except (AttributeError, RuntimeError):
        return None
