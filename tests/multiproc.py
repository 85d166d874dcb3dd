"""Run a function on N real gloo ranks (spawned processes on loopback) and collect results."""

from __future__ import annotations

import datetime
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT = datetime.timedelta(seconds=90)


def run_world(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on every rank of a fresh gloo group; return the results by rank."""
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(fn, world_size, tmp, args), nprocs=world_size, join=True)
        return [torch.load(Path(tmp) / f"{r}.pt", weights_only=False) for r in range(world_size)]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, out_dir: str, args: tuple) -> None:
    torch.set_num_threads(1)
    # A file rendezvous: no port to pick, so tests running side by side cannot collide.
    init = f"file://{Path(out_dir) / 'rendezvous'}"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size, timeout=TIMEOUT)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"{rank}.pt")
        # No rank tears the group down while another still talks to it.
        dist.barrier()
    finally:
        dist.destroy_process_group()
