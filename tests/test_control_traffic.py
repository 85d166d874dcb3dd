"""Control traffic off the critical path (issue 20, item 6): where the agreement allreduce is issued.

Before, flex's agreement allreduce ran at an agreement step's first bucket, between that
bucket's work and its exchange: two round trips on the critical path of every agreement
step.  Now it is issued after the previous step's last exchange and read at the first bucket.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from multiproc import run_world

STEPS = 10
#: Agreement points with measurements due (flex_interval=2; at step 1 no step is closed yet).
MEASURED_AT = (2, 4, 6, 8)


def _record_collectives(log: list[tuple[Any, ...]], lock: threading.Lock) -> None:
    """Every collective this process issues, as ``(name, dtype, numel)``, in issue order."""
    names = [n for n in ("all_reduce", "broadcast", "all_gather_into_tensor", "all_gather_single") if hasattr(dist, n)]
    for name in names:
        original = getattr(dist, name)

        def recorded(tensor: torch.Tensor, *args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            with lock:
                log.append((_name, str(tensor.dtype), tensor.numel()))
            return _original(tensor, *args, **kwargs)

        setattr(dist, name, recorded)


def _record_prepares(state: flexcomm.FlexState, log: list[tuple[Any, ...]], lock: threading.Lock) -> None:
    """Mark every bucket's step protocol (before the planner's work for it) in the same log."""
    prepare = state.prepare

    def recorded(handed: Any) -> Any:
        with lock:
            log.append(("prepare", handed.step, handed.opens_step))
        return prepare(handed)

    state.prepare = recorded  # type: ignore[method-assign]


def _flex_steps(rank: int, world: int) -> dict[str, Any]:
    torch.manual_seed(0)
    # Four 128 x 128 layers (64 KB each) over a 50 KB bucket cap: one bucket per layer.
    model = DDP(nn.Sequential(*(nn.Linear(128, 128) for _ in range(4))), bucket_cap_mb=0.05)
    state = flexcomm.register(model, compressor="flex", density=0.05, flex_interval=2, probe_every=1000)
    log: list[tuple[Any, ...]] = []
    lock = threading.Lock()
    _record_collectives(log, lock)
    _record_prepares(state, log, lock)
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        time.sleep(0.003 * rank * (step % 2))  # ranks measure different times
        model.zero_grad()
        model(torch.randn(8, 128, generator=gen)).square().mean().backward()
    # The last step's end issued the agreement of step STEPS; the checkpoint must hold its values.
    agreement = state.state_dict()["planner"].get("agreement")
    return {"log": log, "agreement": agreement}


def _first_collective_after(log: list[tuple[Any, ...]], start: int) -> tuple[Any, ...]:
    return next(entry for entry in log[start + 1:] if entry[0] != "prepare")


def test_an_agreement_steps_first_collective_is_its_first_buckets_exchange() -> None:
    results = run_world(_flex_steps, 2)
    collectives = [[e for e in r["log"] if e[0] != "prepare"] for r in results]
    assert collectives[0] == collectives[1]  # the same collectives, in the same order, of the same lengths
    log = results[0]["log"]
    opens = {e[1]: i for i, e in enumerate(log) if e[0] == "prepare" and e[2]}
    closes = {e[1]: i for i, e in enumerate(log) if e[0] == "prepare"}  # the step's last bucket
    for step in MEASURED_AT:
        # Before, the fp64 agreement allreduce came first, in front of the bucket's own exchange.
        name, dtype, _ = _first_collective_after(log, opens[step])
        assert dtype != "torch.float64", (step, name, dtype)
        # The agreement went out after the previous step's last bucket, before this step began.
        between = log[closes[step - 1] + 1:opens[step]]
        assert ("all_reduce", "torch.float64") in {e[:2] for e in between}, (step, between)
    # A checkpoint after the last step waited for the agreement issued at its end: the same values on every rank.
    agreements = [r["agreement"] for r in results]
    assert agreements[0] is not None and agreements[0]["measurements"]
    assert agreements[0]["measurements"] == agreements[1]["measurements"]
