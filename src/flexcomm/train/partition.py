"""Splitting a data set's samples among ranks: IID, or label-skewed (Dirichlet), and the label counts per rank.

Pure functions of the labels, the number of ranks and a seed: every rank computes the same split.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["label_histogram", "partition_dirichlet", "partition_iid"]


def _check_partition_args(labels: np.ndarray, world_size: int) -> np.ndarray:
    if isinstance(world_size, bool) or not isinstance(world_size, (int, np.integer)):
        raise ValueError(f"world_size must be an integer, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    labels = np.asarray(labels)
    if labels.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {labels.shape}")
    if len(labels) < world_size:
        raise ValueError(
            f"world_size ({world_size}) exceeds the number of samples ({len(labels)})"
        )
    return labels


def partition_iid(labels: np.ndarray, world_size: int, seed: int = 0) -> list[np.ndarray]:
    """Split sample indices uniformly at random into ``world_size`` disjoint,
    equally sized, sorted int64 index arrays.

    The ``len(labels) % world_size`` left-over samples are dropped so every rank
    runs the same number of steps per epoch.
    """
    labels = _check_partition_args(labels, world_size)
    per_rank = len(labels) // world_size
    perm = np.random.default_rng(seed).permutation(len(labels))
    return [
        np.sort(perm[r * per_rank : (r + 1) * per_rank]).astype(np.int64)
        for r in range(world_size)
    ]


def partition_dirichlet(
    labels: np.ndarray, world_size: int, alpha: float, seed: int = 0
) -> list[np.ndarray]:
    """Non-IID split: each class's samples are divided among ranks in proportions
    drawn from ``Dirichlet(alpha)``; small ``alpha`` means highly skewed labels.

    Returns ``world_size`` disjoint sorted int64 index arrays that together cover
    every sample. A rank left empty receives one sample from the currently largest
    rank, so every rank has at least one. Deterministic for a given ``seed``.
    """
    labels = _check_partition_args(labels, world_size)
    try:
        concentration = float(alpha)
    except (TypeError, ValueError):
        raise ValueError(f"alpha must be a number > 0, got {alpha!r}") from None
    if not (math.isfinite(concentration) and concentration > 0):
        raise ValueError(f"alpha must be a finite number > 0, got {alpha!r}")
    rng = np.random.default_rng(seed)
    shards: list[list[np.ndarray]] = [[] for _ in range(world_size)]
    for cls in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == cls))
        proportions = rng.dirichlet(np.full(world_size, concentration))
        cuts = np.rint(np.cumsum(proportions)[:-1] * len(idx)).astype(np.int64)
        for rank, part in enumerate(np.split(idx, cuts)):
            shards[rank].append(part)
    parts = [np.concatenate(s) for s in shards]
    for rank in range(world_size):
        if len(parts[rank]) == 0:
            donor = max(range(world_size), key=lambda r: len(parts[r]))
            parts[rank] = parts[donor][-1:]
            parts[donor] = parts[donor][:-1]
    return [np.sort(p).astype(np.int64) for p in parts]


def label_histogram(
    labels: np.ndarray, indices: np.ndarray, num_classes: int
) -> np.ndarray:
    """Count of each class among ``labels[indices]``: int64 array of ``num_classes``."""
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    selected = np.asarray(labels)[np.asarray(indices, dtype=np.int64)]
    if selected.size and (selected.min() < 0 or selected.max() >= num_classes):
        raise ValueError(
            f"labels must lie in [0, {num_classes}), "
            f"got {selected.min()}..{selected.max()}"
        )
    return np.bincount(selected, minlength=num_classes).astype(np.int64)
