"""A rank's resume from the newest usable checkpoint set, on the rank count it was saved with or another.

A set saved by N ranks resumes on M ranks (``flexcomm-train --resume --nproc M``, or
torchrun ``--nnodes MIN:MAX`` restarting with the nodes still alive):

* model and optimizer are replicas (DDP applies the same update everywhere): rank r loads
  file r, a new rank (``r >= N``) file 0;
* the hook's state follows :mod:`flexcomm.elastic`: remaining ranks keep their own
  error-feedback residuals and fold in those of the departed ranks ``r + M, r + 2M, ...``
  (their files are read too), new ranks start at zero; leaders, cost model and
  measurements start over; PowerSGD's error feedback is kept by the remaining ranks and
  starts at zero on new ones (its P/Q memories are replicas), the departed ranks' dropped;
* the step counter continues; the data are partitioned for M ranks, and a fresh epoch of
  that partition starts at the resume step (the saved epoch's rest belongs to the old
  partition), so epochs in the records keep counting up;
* each rank's RNG state is its own; a new rank keeps the per-rank seed it started with.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from flexcomm import elastic
from flexcomm.train import checkpoint
from flexcomm.train.config import TrainConfig
from flexcomm.train.rank_data import DataClock, partitions, steps_per_epoch
from flexcomm.train.timed_hook import TimedHook

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SavedSet:
    """What one rank reads of a checkpoint set: its step, rank count, and the files it needs."""

    step: int
    nproc: int
    own: dict[str, Any]  # this rank's file (a new rank: rank 0's)
    departed: list[dict[str, Any]]  # the files of the departed ranks folded into this one

    def is_own(self, rank: int) -> bool:
        return rank < self.nproc


def load_newest_usable(run_dir: Path, rank: int, world_size: int, device: torch.device) -> SavedSet:
    """This rank's files of the newest checkpoint set that every rank can load.

    A damaged file on any rank (truncated, corrupt) makes every rank fall back to the
    previous set: the ranks agree with one allreduce (MIN) per set tried.
    """
    problems = []
    latest = checkpoint.read_latest(run_dir)
    for step, nproc in zip(latest["steps"], latest["nproc"]):
        try:
            saved: SavedSet | None = _read_set(run_dir, rank, world_size, step, nproc, device)
        except checkpoint.CheckpointError as exc:
            saved = None
            problems.append(str(exc))
            log.warning("rank %d: %s", rank, exc)
        usable = torch.tensor([saved is not None], dtype=torch.int32, device=device)
        dist.all_reduce(usable, op=dist.ReduceOp.MIN)
        if usable.item() and saved is not None:
            return saved
        log.warning("rank %d: the checkpoint at step %d is damaged on a rank; trying the previous one", rank, step)
    raise checkpoint.CheckpointError(
        checkpoint.no_usable_checkpoint(checkpoint.checkpoint_dir(run_dir), problems or ["(on another rank)"])
    )


def _read_set(run_dir: Path, rank: int, world_size: int, step: int, nproc: int, device: torch.device) -> SavedSet:
    own, departed = elastic.sources(rank, world_size, nproc)
    return SavedSet(
        step=step, nproc=nproc, own=checkpoint.load_rank(run_dir, own, step, map_location=device),
        departed=[checkpoint.load_rank(run_dir, r, step) for r in departed],
    )


def check_data_order(saved: SavedSet, labels: np.ndarray, cfg: TrainConfig, per_epoch: int) -> None:
    """The saved steps per epoch must be what this data set gives at the saved rank count."""
    expected = per_epoch
    if saved.nproc != cfg.nproc:
        expected = steps_per_epoch(partitions(labels, dataclasses.replace(cfg, nproc=saved.nproc)), cfg.batch_size)
    found = saved.own["data_order"]["steps_per_epoch"]
    if found != expected:
        raise checkpoint.CheckpointError(
            f"cannot resume: the checkpoint's data had {found} steps per epoch, this data set gives {expected} on "
            f"{saved.nproc} rank(s) (did the data set change?)"
        )


def load_comm(hook: TimedHook, saved: SavedSet, rank: int, world_size: int) -> None:
    """The hook's state: as saved, or resized from ``saved.nproc`` ranks (see the module docstring)."""
    comm = saved.own["comm"]
    if saved.nproc == world_size:
        hook.load_state_dict(comm)
    elif hook.is_flexcomm:
        hook.state.load_state_dict(comm, departed_states=[d["comm"] for d in saved.departed])
    elif hook.compressor == "powersgd":
        hook.load_state_dict(comm if saved.is_own(rank) else {**comm, "error_dict": {}})
        log.warning(
            "rank %d: PowerSGD state saved by %d ranks resumes on %d: %s; the departed ranks' errors are dropped",
            rank, saved.nproc, world_size,
            "it keeps its own error feedback" if saved.is_own(rank) else "a new rank, its error feedback starts at zero",
        )


def data_clock(saved: SavedSet, per_epoch: int, world_size: int) -> DataClock:
    """The data order of the resumed run: as saved, or a fresh epoch from the resume step on another rank count."""
    order = saved.own["data_order"]
    if saved.nproc == world_size:
        origin_step, origin_epoch = order.get("origin", (0, 0))  # files written before origins: step 0
        return DataClock(per_epoch, origin_step, origin_epoch)
    return DataClock(per_epoch, saved.step, order["epoch"] + (order["batch"] > 0))
