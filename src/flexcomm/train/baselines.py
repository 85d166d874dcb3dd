"""PyTorch's own DDP comm hooks as baselines: PowerSGD and fp16 compression.

Their state, their hook function, checkpoints of PowerSGD's state in plain types, and
the DDP bucket size PowerSGD needs on gloo.

Why one bucket on gloo: PyTorch's ``powerSGD_hook`` issues its second and third
allreduce (of the Q and P matrices) from ``Future.then`` callbacks.  On gloo those
callbacks run on the process group's worker threads as earlier collectives finish, so
with several buckets two ranks can issue their collectives in different orders, and
gloo pairs messages of different buckets: "Received data size doesn't match expected
size", or a deadlock.  With the whole model in one bucket every rank has exactly one
chain of collectives per step, so the order is the same everywhere.  NCCL enqueues
collectives on a stream in issue order and is what the hook was written for: there
DDP's buckets stay as the user set them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from flexcomm.train.config import TrainConfig

#: PyTorch's PowerSGD needs at least two plain-allreduce steps (its own bucket-rebuild guard).
POWERSGD_MIN_START = 2

_MB = 1024 * 1024


def make_state(cfg: TrainConfig) -> powerSGD_hook.PowerSGDState | None:
    """The hook state of a PyTorch baseline (``None`` for fp16, which keeps none)."""
    if cfg.compressor == "fp16":
        return None
    if cfg.compressor == "powersgd":
        return powerSGD_hook.PowerSGDState(
            process_group=None,
            matrix_approximation_rank=cfg.powersgd_rank or 1,
            start_powerSGD_iter=max(POWERSGD_MIN_START, cfg.warmup_steps),
            random_seed=cfg.seed,
        )
    raise ValueError(f"{cfg.compressor!r} is not one of PyTorch's hooks")


def hook_function(compressor: str) -> Any:
    """PyTorch's hook function for ``compressor`` (``"powersgd"`` or ``"fp16"``)."""
    if compressor == "fp16":
        return default_hooks.fp16_compress_hook
    if compressor == "powersgd":
        return powerSGD_hook.powerSGD_hook
    raise ValueError(f"{compressor!r} is not one of PyTorch's hooks")


def bucket_cap_mb(compressor: str, backend: str, model: nn.Module, requested: float | str | None = None) -> float | None:
    """DDP's ``bucket_cap_mb`` for this run: ``requested`` (``None``: DDP's default; ``"one"``: one bucket),
    except PowerSGD on gloo, which gets one bucket holding every gradient whatever was requested (see the
    module docstring).

    DDP uses the cap for the first bucket too when it is given explicitly, so a cap of at least the
    gradients' size (rounded up to whole MiB) means exactly one bucket.
    """
    if requested == "one" or (compressor == "powersgd" and backend == "gloo"):
        grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return max(1, math.ceil(grad_bytes / _MB))
    if isinstance(requested, str):
        raise ValueError(f"bucket_cap_mb must be a number of MiB or 'one', got {requested!r}")
    return requested


_POWERSGD_FIELDS = (
    "iter",
    "error_dict",
    "p_memory_dict",
    "q_memory_dict",
    "total_numel_before_compression",
    "total_numel_after_compression",
    "next_stats_report",
)


def powersgd_state_dict(state: powerSGD_hook.PowerSGDState) -> dict[str, Any]:
    """PowerSGD's internal state in plain types, so checkpoints load with ``weights_only=True``."""
    name, keys, pos, has_gauss, cached = state.rng.get_state()
    saved = {name_: getattr(state, name_) for name_ in _POWERSGD_FIELDS}
    saved["rng"] = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    return saved


def powersgd_load_state_dict(state: powerSGD_hook.PowerSGDState, saved: dict[str, Any]) -> None:
    """Restore :func:`powersgd_state_dict` into ``state``."""
    for name in _POWERSGD_FIELDS:
        setattr(state, name, saved[name])
    name, keys, pos, has_gauss, cached = saved["rng"]
    state.rng.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
