"""Run a function on N real gloo ranks (spawned processes on loopback) and collect results."""

from __future__ import annotations

import datetime
import faulthandler
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

def raised(call: Callable[[], Any]) -> str:
    """The message of what ``call()`` raises (DDP re-raises a hook's error from backward), or ``"no error"``."""
    try:
        call()
    except Exception as err:
        return str(err)
    return "no error"


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 90.0, sync_exit: bool = True) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` on every rank of a fresh gloo group; return the results by rank.

    ``timeout_s`` is the process group's timeout; ``sync_exit=False`` skips the closing
    barrier, for tests whose ranks deliberately leave the group out of step.
    """
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_entry, args=(fn, world_size, tmp, args, timeout_s, sync_exit), nprocs=world_size, join=True)
        return [torch.load(Path(tmp) / f"{r}.pt", weights_only=False) for r in range(world_size)]


def _entry(rank: int, fn: Callable[..., Any], world_size: int, out_dir: str, args: tuple, timeout_s: float, sync_exit: bool) -> None:
    faulthandler.enable(all_threads=True)  # an abort prints every thread's Python stack
    torch.set_num_threads(1)
    # A file rendezvous: no port to pick, so tests running side by side cannot collide.
    init = f"file://{Path(out_dir) / 'rendezvous'}"
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world_size, timeout=timeout)
    try:
        result = fn(rank, world_size, *args)
        torch.save(result, Path(out_dir) / f"{rank}.pt")
        if sync_exit:
            # No rank tears the group down while another still talks to it.  On a group of
            # its own: a hook state on the default group may still issue its step end's
            # agreement from its dispatcher thread, and the two would pair up differently
            # on different ranks ("Received data size doesn't match expected size").
            dist.barrier(group=dist.new_group())
    finally:
        dist.destroy_process_group()
    # Result saved, group gone: leave without interpreter finalization.  A rank aborted
    # there now and then ("terminate called without an active exception", about once per
    # full suite on a loaded machine; cause not found), failing a test whose work was done.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
