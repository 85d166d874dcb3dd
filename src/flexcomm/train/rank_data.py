"""What each rank trains and evaluates on: data set, partition, batch order.

Everything here is a pure function of the :class:`~flexcomm.train.config.TrainConfig`
and the rank, so that (a) the launcher can check the data before any rank starts and
(b) a resumed run finds its place in the data order from the step number alone:
rank r's batch at step s is ``batch_indices(...)`` of ``(seed, epoch, r)``, whatever
happened before.  A run resumed on another rank count has another partition: its
:class:`DataClock` starts a fresh epoch at the resume step.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from flexcomm.train.config import TrainConfig
from flexcomm.train.datasets import (
    compute_mean_std,
    load_idx_dataset,
    load_npz_dataset,
    synthetic_dataset,
    to_tensor_dataset,
)
from flexcomm.train.partition import label_histogram, partition_dirichlet, partition_iid

DATASETS = ("fashion-mnist", "synthetic", "npz")
PARTITIONS = ("iid", "dirichlet")
#: Sizes of the synthetic set when no subset is asked for.
SYNTHETIC_TRAIN, SYNTHETIC_TEST = 10_000, 2_000
DEFAULT_DIRICHLET_ALPHA = 0.5


@dataclass(frozen=True)
class Arrays:
    """Raw images (uint8 or float, NHW or NCHW) and int64 labels of both splits."""

    train_x: np.ndarray
    train_y: np.ndarray
    test_x: np.ndarray
    test_y: np.ndarray

    @property
    def num_classes(self) -> int:
        return int(max(self.train_y.max(initial=0), self.test_y.max(initial=0))) + 1

    @property
    def in_channels(self) -> int:
        return 1 if self.train_x.ndim == 3 else int(self.train_x.shape[1])

    @property
    def image_size(self) -> int:
        return int(self.train_x.shape[-1])


def load_arrays(cfg: TrainConfig) -> Arrays:
    """Both splits of ``cfg.dataset``, cut to ``--train-subset``/``--test-subset``.

    Raises ``ValueError``/``FileNotFoundError`` with a message naming the option at fault.
    """
    if cfg.dataset == "synthetic":
        n_train = cfg.train_subset or SYNTHETIC_TRAIN
        n_test = cfg.test_subset or SYNTHETIC_TEST
        # One draw for both splits: the class templates depend on the seed.
        x, y = synthetic_dataset(n_train + n_test, seed=cfg.seed)
        return Arrays(x[:n_train], y[:n_train], x[n_train:], y[n_train:])
    if cfg.dataset == "fashion-mnist":
        train_x, train_y = load_idx_dataset(cfg.data_dir, train=True)
        test_x, test_y = load_idx_dataset(cfg.data_dir, train=False)
    elif cfg.dataset == "npz":
        train_x, train_y, test_x, test_y = _load_npz_pair(Path(str(cfg.data_dir)))
    else:
        raise ValueError(f"unknown --dataset {cfg.dataset!r}; valid: {', '.join(DATASETS)}")
    arrays = Arrays(
        _first(train_x, cfg.train_subset),
        _first(train_y, cfg.train_subset),
        _first(test_x, cfg.test_subset),
        _first(test_y, cfg.test_subset),
    )
    _check_geometry(arrays)
    return arrays


def _load_npz_pair(data_dir: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    files = {split: data_dir / f"{split}.npz" for split in ("train", "test")}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        raise FileNotFoundError(
            f"--dataset npz needs train.npz and test.npz (arrays x and y) in --data-dir; missing {', '.join(missing)}"
        )
    train_x, train_y = load_npz_dataset(files["train"])
    test_x, test_y = load_npz_dataset(files["test"])
    return train_x, train_y, test_x, test_y


def _first(array: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` samples, or all of them when ``n`` is 0 or at least their number.

    A cap rather than an error, so that the demo-sized defaults also work on small data sets.
    """
    return array[:n] if n else array


def _check_geometry(arrays: Arrays) -> None:
    if arrays.train_x.shape[1:] != arrays.test_x.shape[1:]:
        raise ValueError(
            f"training images {arrays.train_x.shape[1:]} and test images {arrays.test_x.shape[1:]} differ in shape"
        )
    if arrays.train_x.shape[-1] != arrays.train_x.shape[-2]:
        raise ValueError(f"images must be square, got {arrays.train_x.shape[-2]}x{arrays.train_x.shape[-1]}")


def partitions(labels: np.ndarray, cfg: TrainConfig) -> list[np.ndarray]:
    """Every rank's training sample indices (the same on every rank: seeded by ``cfg.seed``)."""
    if cfg.partition == "iid":
        return partition_iid(labels, cfg.nproc, seed=cfg.seed)
    alpha = DEFAULT_DIRICHLET_ALPHA if cfg.dirichlet_alpha is None else cfg.dirichlet_alpha
    return partition_dirichlet(labels, cfg.nproc, alpha, seed=cfg.seed)


def steps_per_epoch(parts: list[np.ndarray], batch_size: int) -> int:
    """Full batches per epoch, the same on every rank (DDP needs every rank at every step).

    With uneven (Dirichlet) partitions, the smallest one sets the pace and larger ones
    see a fresh random subset of their samples each epoch.
    """
    smallest = min(range(len(parts)), key=lambda r: len(parts[r]))
    if len(parts[smallest]) < batch_size:
        raise ValueError(
            f"rank {smallest} gets only {len(parts[smallest])} training samples, fewer than --batch-size "
            f"{batch_size}; use more data (--train-subset), fewer ranks (--nproc), a smaller batch, "
            "or a larger --dirichlet-alpha"
        )
    return len(parts[smallest]) // batch_size


@dataclass(frozen=True)
class DataClock:
    """Where a step falls in the data order: epochs of ``per_epoch`` steps counted from an origin.

    The origin is step 0, epoch 0, until a run resumes on another rank count; then it is
    the resume step and a new epoch (see :mod:`flexcomm.train.resume`).
    """

    per_epoch: int
    origin_step: int = 0
    origin_epoch: int = 0

    def position(self, step: int) -> tuple[int, int]:
        """``(epoch, batch within the epoch)`` of ``step``."""
        epoch, batch = divmod(step - self.origin_step, self.per_epoch)
        return self.origin_epoch + epoch, batch


def batch_indices(part_size: int, epoch: int, batch: int, batch_size: int, seed: int, rank: int) -> np.ndarray:
    """Positions within rank ``rank``'s partition of its ``batch``-th batch of ``epoch``.

    Each epoch is a fresh permutation drawn from ``(seed, epoch, rank)``, so the order
    is reproducible and needs no state beyond the step.
    """
    order = np.random.default_rng([seed, epoch, rank]).permutation(part_size)
    return order[batch * batch_size : (batch + 1) * batch_size]


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> list[list[int]]:
    """Per-rank class counts, logged so a non-IID split can be seen."""
    return [label_histogram(labels, part, num_classes).tolist() for part in parts]


@dataclass
class RankData:
    """One rank's tensors: its training partition and its shard of the test set."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def rank_tensors(arrays: Arrays, part: np.ndarray, rank: int, world_size: int, device: torch.device) -> RankData:
    """Normalise (with the training subset's statistics) and move one rank's data to ``device``.

    The test set is sharded round-robin over ranks; accuracy is summed across ranks.
    """
    mean, std = compute_mean_std(arrays.train_x)
    train = to_tensor_dataset(arrays.train_x[part], arrays.train_y[part], mean, std)
    shard = np.arange(rank, len(arrays.test_y), world_size)
    test = to_tensor_dataset(arrays.test_x[shard], arrays.test_y[shard], mean, std)
    return RankData(*(t.to(device) for t in (*train.tensors, *test.tensors)))
