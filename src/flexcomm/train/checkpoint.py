"""Checkpoints: one file per rank per step, written atomically, plus a pointer to the newest set.

Each rank writes its own file because the error-feedback residuals (and PowerSGD's
memories) differ per rank.  A file is written to a temporary name in the same directory
and ``os.replace``d into place, so a crash never leaves a half-written file under the
real name.  Ranks cannot replace their files together, so file names carry the step and
``ckpt/latest.json`` (also replaced atomically, by rank 0, once every rank has saved)
names the newest complete set; older files are deleted only after that.

A file holds ``meta`` (format, step, rank and the settings in :data:`RESUME_KEYS`),
model, optimizer, the hook's state, RNG states, the data order position (epoch and
batch; the order itself follows from the seed, see :mod:`flexcomm.train.rank_data`) and
the elapsed wall time.  Only plain
types and tensors are stored, so loading uses ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from flexcomm.train.config import TrainConfig

CHECKPOINT_DIR = "ckpt"
LATEST_FILE = "latest.json"
FORMAT = 1
#: Settings a checkpoint is tied to: another value would load state that does not fit
#: (model, hook state, world size) or lose the run's place in the data order.
RESUME_KEYS = (
    "model",
    "width",
    "compressor",
    "nproc",
    "dataset",
    "train_subset",
    "partition",
    "dirichlet_alpha",
    "batch_size",
    "seed",
    "powersgd_rank",
)


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or belongs to a different run set-up."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


def rank_file(run_dir: Path, rank: int, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step{step:08d}-rank{rank}.pt"


def tied_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings in :data:`RESUME_KEYS` of ``cfg``."""
    values = cfg.to_dict()
    return {key: values[key] for key in RESUME_KEYS}


def save_rank(run_dir: Path, cfg: TrainConfig, rank: int, step: int, state: dict[str, Any]) -> Path:
    """Atomically write this rank's ``state`` for ``step`` (``meta`` is added here)."""
    path = rank_file(run_dir, rank, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": {"format": FORMAT, "step": step, "rank": rank, "config": tied_settings(cfg)}, **state}
    _atomic_write(path, lambda f: torch.save(payload, f))
    return path


def publish(run_dir: Path, cfg: TrainConfig, step: int) -> None:
    """Point ``latest.json`` at ``step``; call once every rank's file for it exists."""
    latest = {"format": FORMAT, "step": step, "config": tied_settings(cfg)}
    _atomic_write(checkpoint_dir(run_dir) / LATEST_FILE, lambda f: f.write(json.dumps(latest, indent=2).encode()))


def prune(run_dir: Path, rank: int, keep_step: int) -> None:
    """Delete this rank's files of other steps; only after :func:`publish` moved on."""
    keep = rank_file(run_dir, rank, keep_step).name
    for path in checkpoint_dir(run_dir).glob(f"step*-rank{rank}.pt"):
        if path.name != keep:
            path.unlink(missing_ok=True)


def read_latest(run_dir: Path) -> dict[str, Any]:
    path = checkpoint_dir(run_dir) / LATEST_FILE
    if not path.exists():
        raise CheckpointError(
            f"cannot resume: {run_dir} has no checkpoint ({path} is missing; was the run started with "
            "--checkpoint-every?)"
        )
    try:
        latest = json.loads(path.read_text())
        step = int(latest["step"])
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"cannot resume: {path} is corrupt ({exc})") from None
    if latest.get("format") != FORMAT:
        raise CheckpointError(f"cannot resume: {path} has format {latest.get('format')!r}, expected {FORMAT}")
    latest["step"] = step
    return latest


def load_rank(
    run_dir: Path, rank: int, step: int, map_location: str | torch.device = "cpu", mmap: bool = False
) -> dict[str, Any]:
    """Load and sanity-check one rank's file; every failure is a :class:`CheckpointError`."""
    path = rank_file(run_dir, rank, step)
    if not path.exists():
        raise CheckpointError(f"cannot resume: checkpoint file {path} is missing")
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        meta = payload["meta"]
    except Exception as exc:  # noqa: BLE001 - torch reports truncation as several exception types
        raise CheckpointError(f"cannot resume: checkpoint file {path} is truncated or corrupt ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("rank") != rank or meta.get("step") != step:
        raise CheckpointError(
            f"cannot resume: {path} holds format {meta.get('format')!r}, rank {meta.get('rank')!r}, "
            f"step {meta.get('step')!r}; expected format {FORMAT}, rank {rank}, step {step}"
        )
    return payload


def check_compatible(saved: dict[str, Any], cfg: TrainConfig, where: Path) -> None:
    """Refuse a checkpoint written with other :data:`RESUME_KEYS` settings, naming each one."""
    mine = tied_settings(cfg)
    diffs = [
        f"--{key.replace('_', '-')} {saved.get(key)!r} (this run: {mine[key]!r})"
        for key in RESUME_KEYS
        if saved.get(key) != mine[key]
    ]
    if diffs:
        raise CheckpointError(f"cannot resume from {where}: the checkpoint was written with " + ", ".join(diffs))


def validate_resume(run_dir: Path, cfg: TrainConfig) -> int:
    """Check, before any rank starts, that every rank can resume; return the step to resume from."""
    latest = read_latest(run_dir)
    where = checkpoint_dir(run_dir)
    check_compatible(latest["config"], cfg, where)
    step = latest["step"]
    if cfg.steps is not None and step >= cfg.steps:
        raise CheckpointError(
            f"cannot resume: the checkpoint is at step {step}, and this run stops at step {cfg.steps}; "
            "pass a larger --steps (or --epochs) to continue training"
        )
    for rank in range(cfg.nproc):
        check_compatible(load_rank(run_dir, rank, step, mmap=True)["meta"]["config"], cfg, where)
    return step


def _atomic_write(path: Path, write: Callable[[IO[bytes]], Any]) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
