"""One training run's settings, shared by the launcher and every rank.

The launcher validates the command line into a :class:`TrainConfig`, resolves what
depends on the machine (the network, the number of steps) and writes it to
``config.json`` in the run directory; each rank reads that file back.  Passing one
file instead of re-serialising options on the command line keeps the launcher and
the ranks from ever disagreeing about a setting.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import flexcomm

#: Compressors implemented by PyTorch's own DDP hooks, offered as baselines.
TORCH_COMPRESSORS = ("powersgd", "fp16")

CONFIG_FILE = "config.json"


def available_compressors() -> tuple[str, ...]:
    """flexcomm's compressors (read from the package, so new ones appear here) plus PyTorch's."""
    return tuple(flexcomm.COMPRESSORS) + TORCH_COMPRESSORS


@dataclass
class TrainConfig:
    """Every setting of a run; see ``flexcomm-train --help`` for their meaning.

    After the launcher has resolved it, ``net`` is the schedule really used
    (``"none"`` for plain loopback) and ``steps`` the number of steps to run.
    """

    model: str = "resnet18"
    width: float = 0.125
    dataset: str = "fashion-mnist"
    data_dir: str | None = None
    train_subset: int = 10_000
    test_subset: int = 2000
    partition: str = "iid"
    dirichlet_alpha: float | None = None
    compressor: str = "artopk-star"
    density: float | str | None = 0.01  # "auto": the dynamic compression-ratio controller
    warmup_steps: int = 0
    auto_warmup: int = 0  # --density auto: the controller's warm-up, measurement interval and rule
    auto_every: int = 50
    auto_rule: str = "goodput"
    auto_min_gain: float = 0.7
    powersgd_rank: int | None = None
    bucket_cap_mb: float | str | None = None  # DDP's bucket_cap_mb, "one": one bucket; None: DDP's default
    nproc: int = 2
    net: str = "auto"
    steps: int | None = None
    epochs: float | None = None
    batch_size: int = 32
    lr: float = 0.05
    momentum: float = 0.9
    eval_every: int = 50
    target_acc: float | None = None
    seed: int = 0
    out: str | None = None
    checkpoint_every: int = 0
    resume: bool = False
    timeout: float = 300.0
    threads: int = 1
    device: str = "auto"  # "auto": CUDA where available, else CPU
    report: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"unknown config keys {unknown} (written by another flexcomm version?)")
        return cls(**data)

    def save(self, run_dir: Path) -> Path:
        path = run_dir / CONFIG_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: Path) -> TrainConfig:
        return cls.from_dict(json.loads(Path(path).read_text()))
