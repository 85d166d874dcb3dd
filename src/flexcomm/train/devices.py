"""Where a rank of flexcomm-train computes, and over which backend its group talks.

torchrun's ``LOCAL_RANK`` counts the ranks of one node; an emulated cluster gives every
rank a host of its own (``LOCAL_RANK`` 0 everywhere) while all of them share this one
machine's GPUs, so the launcher also says where a rank stands on the machine
(:data:`MACHINE_RANK_ENV`, :data:`MACHINE_RANKS_ENV`).  Each rank takes GPU
``machine rank mod GPUs``; NCCL refuses two ranks on one GPU, so when ranks outnumber
GPUs the group uses gloo with CUDA tensors instead.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from flexcomm.launch import MACHINE_RANK_ENV, MACHINE_RANKS_ENV

DEVICE_CHOICES = ("auto", "cpu", "cuda")


def choose_device(requested: str, env: Mapping[str, str], gpus: int) -> tuple[torch.device, str]:
    """``(device, backend)`` for a rank: ``requested`` is one of :data:`DEVICE_CHOICES`, ``gpus`` the visible GPUs."""
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"device must be one of {', '.join(DEVICE_CHOICES)}, got {requested!r}")
    if requested == "cuda" and gpus == 0:
        raise ValueError("--device cuda, but torch sees no CUDA device on this machine (use --device cpu)")
    if requested == "cpu" or gpus == 0:
        return torch.device("cpu"), "gloo"
    machine_rank = int(env.get(MACHINE_RANK_ENV, env.get("LOCAL_RANK", "0")))
    machine_ranks = int(env.get(MACHINE_RANKS_ENV, env.get("LOCAL_WORLD_SIZE", "1")))
    backend = "nccl" if machine_ranks <= gpus else "gloo"
    return torch.device("cuda", machine_rank % gpus), backend
