"""Checkpoints: one file per rank per step, written atomically, plus a pointer to the newest sets.

Each rank writes its own file because the error-feedback residuals (and PowerSGD's
memories) differ per rank.  A file is written to a temporary name in the same directory
and ``os.replace``d into place, so a crash never leaves a half-written file under the
real name.  Ranks cannot replace their files together, so file names carry the step and
``ckpt/latest.json`` (also replaced atomically, by rank 0, once every rank has saved)
names the newest complete sets, newest first, with the number of ranks that wrote each
(a resumed run may have another, see :mod:`flexcomm.train.resume`): the last :data:`KEEP`
steps are kept, and older files are deleted only after ``latest.json`` moved on.

A file is :data:`MAGIC`, the SHA-256 of the rest, then ``torch.save``'s bytes, so a
file truncated or damaged after it was written (disk, copy, a full file system) is
detected on load with a message naming it, and the resume falls back to the previous set.

A file holds ``meta`` (format, step, rank and the settings in :data:`RESUME_KEYS`),
model, optimizer, the hook's state, RNG states, the data order position (epoch and
batch; the order itself follows from the seed, see :mod:`flexcomm.train.rank_data`) and
the elapsed wall time.  Only plain
types and tensors are stored, so loading uses ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

from flexcomm.train.config import TrainConfig

CHECKPOINT_DIR = "ckpt"
LATEST_FILE = "latest.json"
FORMAT = 2
#: Start of every rank file; the SHA-256 digest of the payload follows, then the payload.
MAGIC = b"FLEXCKPT"
_HEADER = len(MAGIC) + hashlib.sha256().digest_size
#: Complete checkpoint sets kept: the newest, and the one to fall back to if it is damaged.
KEEP = 2

log = logging.getLogger(__name__)
#: Settings a checkpoint records; all but :data:`ELASTIC_KEYS` tie it: another value would
#: load state that does not fit (model, hook state) or lose the run's place in the data order.
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
#: Recorded settings a resumed run may change: the number of ranks (the data partition is
#: recomputed for it and the hook's state resized, see :mod:`flexcomm.train.resume`).
ELASTIC_KEYS = ("nproc",)


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or belongs to a different run set-up."""


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / CHECKPOINT_DIR


_RANK_FILE = re.compile(r"step\d+-rank(\d+)\.pt")


def rank_file(run_dir: Path, rank: int, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step{step:08d}-rank{rank}.pt"


def tied_settings(cfg: TrainConfig) -> dict[str, Any]:
    """The settings in :data:`RESUME_KEYS` of ``cfg``."""
    values = cfg.to_dict()
    return {key: values[key] for key in RESUME_KEYS}


def save_rank(run_dir: Path, cfg: TrainConfig, rank: int, step: int, state: dict[str, Any]) -> Path:
    """Atomically write this rank's ``state`` for ``step`` (``meta`` and the digest are added here)."""
    path = rank_file(run_dir, rank, step)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {"meta": {"format": FORMAT, "step": step, "rank": rank, "config": tied_settings(cfg)}, **state}
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    _atomic_write(path, lambda f: _write_with_digest(f, buffer.getbuffer()))
    return path


def _write_with_digest(f: IO[bytes], data: memoryview) -> None:
    f.write(MAGIC)
    f.write(hashlib.sha256(data).digest())
    f.write(data)


def publish(run_dir: Path, cfg: TrainConfig, step: int) -> None:
    """Make ``step`` the newest complete set; call once every rank's file for it exists."""
    path = checkpoint_dir(run_dir) / LATEST_FILE
    previous = read_latest(run_dir) if path.exists() else {"steps": [], "nproc": []}
    older = [(s, n) for s, n in zip(previous["steps"], previous["nproc"]) if s != step]
    steps, nproc = zip(*[(step, cfg.nproc), *older][:KEEP])
    latest = {"format": FORMAT, "step": step, "steps": list(steps), "nproc": list(nproc), "config": tied_settings(cfg)}
    _atomic_write(path, lambda f: f.write(json.dumps(latest, indent=2).encode()))


def prune(run_dir: Path, rank: int, world_size: int) -> None:
    """Delete the files of steps ``latest.json`` no longer lists; only after :func:`publish`.

    This rank deletes those of every rank ``j`` with ``j mod world_size == rank``: its own,
    and those of ranks a resumed run no longer has (saved with more ranks).
    """
    latest = read_latest(run_dir)
    keep = {rank_file(run_dir, r, step).name for step, nproc in zip(latest["steps"], latest["nproc"]) for r in range(nproc)}
    for path in checkpoint_dir(run_dir).glob("step*-rank*.pt"):
        match = _RANK_FILE.fullmatch(path.name)
        if match and int(match.group(1)) % world_size == rank and path.name not in keep:
            path.unlink(missing_ok=True)


def read_latest(run_dir: Path) -> dict[str, Any]:
    """``latest.json``: ``steps`` (newest first) and ``nproc``, the ranks that wrote each set."""
    path = checkpoint_dir(run_dir) / LATEST_FILE
    if not path.exists():
        raise CheckpointError(
            f"cannot resume: {run_dir} has no checkpoint ({path} is missing; was the run started with "
            "--checkpoint-every?)"
        )
    try:
        latest = json.loads(path.read_text())
        fmt = latest.get("format")
        steps = [int(s) for s in latest["steps"]] if fmt == FORMAT else []
        # Written before runs could change their rank count: every set has the config's.
        nproc = [int(n) for n in latest.get("nproc", [latest["config"]["nproc"]] * len(steps))]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"cannot resume: {path} is corrupt ({exc})") from None
    if fmt != FORMAT:
        raise CheckpointError(f"cannot resume: {path} has format {fmt!r}, expected {FORMAT}")
    if not steps:
        raise CheckpointError(f"cannot resume: {path} lists no checkpoint")
    if len(nproc) != len(steps):
        raise CheckpointError(f"cannot resume: {path} is corrupt (it lists {len(steps)} steps but {len(nproc)} rank counts)")
    latest["step"], latest["steps"], latest["nproc"] = steps[0], steps, nproc
    return latest


def load_rank(run_dir: Path, rank: int, step: int, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and check one rank's file (digest, then contents); every failure is a :class:`CheckpointError`."""
    path = rank_file(run_dir, rank, step)
    if not path.exists():
        raise CheckpointError(f"cannot resume: checkpoint file {path} is missing")
    data = path.read_bytes()
    if not data.startswith(MAGIC) or hashlib.sha256(data[_HEADER:]).digest() != data[len(MAGIC) : _HEADER]:
        raise CheckpointError(
            f"cannot resume: checkpoint file {path} is truncated or corrupt "
            f"({len(data)} bytes; its SHA-256 does not match the one written with it)"
        )
    try:
        payload = torch.load(io.BytesIO(data[_HEADER:]), map_location=map_location, weights_only=True)
        meta = payload["meta"]
    except Exception as exc:  # noqa: BLE001 - a payload that hashes right but does not load: say why
        raise CheckpointError(f"cannot resume: checkpoint file {path} is truncated or corrupt ({exc})") from None
    if meta.get("format") != FORMAT or meta.get("rank") != rank or meta.get("step") != step:
        raise CheckpointError(
            f"cannot resume: {path} holds format {meta.get('format')!r}, rank {meta.get('rank')!r}, "
            f"step {meta.get('step')!r}; expected format {FORMAT}, rank {rank}, step {step}"
        )
    return payload


def check_compatible(saved: dict[str, Any], cfg: TrainConfig, where: Path) -> None:
    """Refuse a checkpoint written with other :data:`RESUME_KEYS` settings (bar :data:`ELASTIC_KEYS`), naming each one."""
    mine = tied_settings(cfg)
    diffs = [
        f"--{key.replace('_', '-')} {saved.get(key)!r} (this run: {mine[key]!r})"
        for key in RESUME_KEYS
        if key not in ELASTIC_KEYS and saved.get(key) != mine[key]
    ]
    if diffs:
        raise CheckpointError(f"cannot resume from {where}: the checkpoint was written with " + ", ".join(diffs))


def validate_resume(run_dir: Path, cfg: TrainConfig) -> int:
    """Check, before any rank starts, that every rank can resume; return the step to resume from.

    A damaged newest set is skipped with a logged warning (the ranks, resuming, skip it too).
    """
    latest = read_latest(run_dir)
    where = checkpoint_dir(run_dir)
    check_compatible(latest["config"], cfg, where)
    problems = []
    for step, nproc in zip(latest["steps"], latest["nproc"]):
        try:
            settings = [load_rank(run_dir, rank, step)["meta"]["config"] for rank in range(nproc)]
        except CheckpointError as exc:
            problems.append(str(exc))
            log.warning("%s; trying the previous checkpoint", exc)
            continue
        for saved in settings:
            check_compatible(saved, cfg, where)
        if cfg.steps is not None and step >= cfg.steps:
            raise CheckpointError(
                f"cannot resume: the checkpoint is at step {step}, and this run stops at step {cfg.steps}; "
                "pass a larger --steps (or --epochs) to continue training"
            )
        return step
    raise CheckpointError(no_usable_checkpoint(where, problems))


def no_usable_checkpoint(where: Path, problems: list[str]) -> str:
    return f"cannot resume: no complete, undamaged checkpoint in {where}:\n  " + "\n  ".join(problems)


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
