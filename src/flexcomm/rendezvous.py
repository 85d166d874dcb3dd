"""Join the default process group so that a restarted job never meets its dead previous attempt.

``flexcomm.init_process_group()`` is ``torch.distributed.init_process_group`` with
torchrun's ``env://`` contract (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``), made safe for restarts:

* **Under torchrun's agent** (``TORCHELASTIC_USE_AGENT_STORE=True``, torch >= 2.4's
  default) every restart attempt gets the same ``MASTER_PORT``: the agent's one
  TCPStore lives for the whole job.  gloo publishes each rank's address under fixed
  keys and reads its peers' with a ``get`` that returns at once when the key exists,
  so a restarted rank can read an address of the dead attempt and hang in
  ``connectFullMesh`` or fail with "Connection refused".  A prefix per attempt
  (``TORCHELASTIC_RESTART_COUNT``) fixes one node, but agents on different nodes count
  restarts differently (an agent restarted by another node's failure does not count
  it), so the prefixes would not match.  Instead rank 0 hosts a fresh TCPStore for
  this attempt on a free port and publishes its address in the agent's store; the
  other ranks read that address and connect.  An address left by a dead attempt
  refuses connections (its process is gone: the agent stops every worker before it
  starts the next attempt), so a rank that read one simply reads again.  The gloo
  keys then live in a store no earlier attempt has touched.
* **Otherwise** (our own launcher, plain ``env://`` scripts, torchrun with
  ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``) rank 0 hosts the store at
  ``MASTER_ADDR:MASTER_PORT``, as ``env://`` does: every attempt's rank 0 is a new
  process, so its store is new too.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["init_process_group", "DEFAULT_TIMEOUT"]

#: Long enough for slow links and start-up on a loaded machine, short enough that a dead
#: or stopped peer turns into an error within minutes (gloo's own default is 30 minutes).
DEFAULT_TIMEOUT = timedelta(minutes=5)
#: Key in the agent's store under which rank 0 publishes its attempt's store address.
STORE_ADDRESS_KEY = "flexcomm/attempt-store"
_RETRY_S = 0.1


def init_process_group(backend: str | None = None, timeout: timedelta | float = DEFAULT_TIMEOUT, **kwargs: Any) -> None:
    """Initialize the default process group from torchrun's environment, restart-safe.

    Args:
        backend: as for ``torch.distributed.init_process_group`` (``None``: gloo for CPU,
            NCCL for CUDA).
        timeout: for the rendezvous and every collective (a ``timedelta`` or seconds): a
            dead or stopped peer makes the others fail after this long instead of hanging.
        **kwargs: passed on (``device_id``, ``pg_options``, ...); not ``init_method``,
            ``store``, ``rank`` or ``world_size``, which come from the environment.
    """
    taken = sorted({"init_method", "store", "rank", "world_size"} & kwargs.keys())
    if taken:
        raise ValueError(
            f"flexcomm.init_process_group takes {', '.join(taken)} from torchrun's environment; "
            "call torch.distributed.init_process_group to pass them yourself"
        )
    if not isinstance(timeout, timedelta):
        timeout = timedelta(seconds=float(timeout))
    rank, world_size = int(_env("RANK")), int(_env("WORLD_SIZE"))
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = _attempt_store(rank, timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout, **kwargs)
    else:
        dist.init_process_group(backend, init_method="env://", timeout=timeout, **kwargs)


def _env(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(
            f"flexcomm.init_process_group needs {name} in the environment (set by torchrun or flexcomm's launcher)"
        )
    return value


def _attempt_store(rank: int, timeout: timedelta) -> dist.TCPStore:
    """This attempt's own store: hosted by rank 0, found by the others through the agent's store."""
    master_addr, master_port = _env("MASTER_ADDR"), int(_env("MASTER_PORT"))
    agent = dist.TCPStore(master_addr, master_port, is_master=False, timeout=timeout)
    if rank == 0:
        host = _address_facing(master_addr, master_port)
        store = dist.TCPStore(host, 0, is_master=True, timeout=timeout, wait_for_workers=False)
        agent.set(STORE_ADDRESS_KEY, f"{host}:{store.port}")
        return store
    deadline = time.monotonic() + timeout.total_seconds()
    while True:
        agent.wait([STORE_ADDRESS_KEY])
        host, port = agent.get(STORE_ADDRESS_KEY).decode().rsplit(":", 1)
        if _accepts_connections(host, int(port)):
            return dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"rank {rank}: rank 0 did not publish a reachable store within {timeout} "
                f"(last address read: {host}:{port})"
            )
        time.sleep(_RETRY_S)  # a dead attempt's address: rank 0 of this attempt has not published yet


def _address_facing(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what peers that reach ``host`` can reach)."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(address)  # UDP: picks the route and source address, sends nothing
        return str(probe.getsockname()[0])


def _accepts_connections(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False
