"""Tests for flexcomm.train.partition: IID and Dirichlet splits among ranks, label histograms."""

from __future__ import annotations

import numpy as np
import pytest

from flexcomm.train.partition import label_histogram, partition_dirichlet, partition_iid


def balanced_labels(n: int = 10_000, classes: int = 10) -> np.ndarray:
    return np.random.default_rng(123).permutation(np.arange(n) % classes)


def assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    merged = np.concatenate(parts)
    assert len(merged) == n
    assert np.array_equal(np.sort(merged), np.arange(n))


def mean_tv_distance(labels: np.ndarray, parts: list[np.ndarray], classes: int) -> float:
    """Mean total-variation distance between each rank's label mix and the global mix."""
    overall = np.bincount(labels, minlength=classes) / len(labels)
    tvs = []
    for part in parts:
        hist = label_histogram(labels, part, classes)
        tvs.append(0.5 * np.abs(hist / hist.sum() - overall).sum())
    return float(np.mean(tvs))


def test_partition_iid() -> None:
    labels = balanced_labels(1000)
    parts = partition_iid(labels, world_size=8, seed=0)
    assert [len(p) for p in parts] == [125] * 8
    assert all(p.dtype == np.int64 for p in parts)
    assert_disjoint_cover(parts, 1000)
    again = partition_iid(labels, world_size=8, seed=0)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition_iid(labels, world_size=8, seed=1)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_partition_iid_drops_remainder_equally() -> None:
    parts = partition_iid(balanced_labels(103), world_size=4, seed=0)
    assert [len(p) for p in parts] == [25] * 4
    merged = np.concatenate(parts)
    assert len(np.unique(merged)) == 100 and merged.max() < 103
    assert_disjoint_cover(partition_iid(np.zeros(7, int), world_size=1), 7)


def test_partition_dirichlet_cover_and_determinism() -> None:
    labels = balanced_labels(5000)
    parts = partition_dirichlet(labels, world_size=6, alpha=0.5, seed=3)
    assert len(parts) == 6 and all(len(p) > 0 for p in parts)
    assert all(p.dtype == np.int64 for p in parts)
    assert_disjoint_cover(parts, 5000)
    again = partition_dirichlet(labels, world_size=6, alpha=0.5, seed=3)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition_dirichlet(labels, world_size=6, alpha=0.5, seed=4)
    assert not all(np.array_equal(a, b) for a, b in zip(parts, other))


def test_partition_dirichlet_every_rank_nonempty() -> None:
    # 3 classes over 20 ranks with tiny alpha: most ranks get no sample from the draw.
    labels = balanced_labels(60, classes=3)
    for seed in range(5):
        parts = partition_dirichlet(labels, world_size=20, alpha=0.01, seed=seed)
        assert min(len(p) for p in parts) >= 1
        assert_disjoint_cover(parts, 60)
    # Exactly as many samples as ranks: one each.
    parts = partition_dirichlet(labels[:20], world_size=20, alpha=0.01, seed=0)
    assert [len(p) for p in parts] == [1] * 20


def test_dirichlet_small_alpha_is_skewed() -> None:
    labels = balanced_labels()
    iid = mean_tv_distance(labels, partition_iid(labels, 8, seed=0), 10)
    skewed = mean_tv_distance(labels, partition_dirichlet(labels, 8, alpha=0.1, seed=0), 10)
    mild = mean_tv_distance(labels, partition_dirichlet(labels, 8, alpha=1000.0, seed=0), 10)
    assert iid < 0.05
    assert mild < 0.05
    assert skewed > 0.4
    assert skewed > 8 * iid


def test_label_histogram() -> None:
    labels = np.array([0, 1, 1, 2, 2, 2])
    hist = label_histogram(labels, np.array([1, 3, 4, 5]), num_classes=4)
    assert hist.tolist() == [0, 1, 3, 0] and hist.dtype == np.int64
    assert label_histogram(labels, np.array([], dtype=np.int64), 3).tolist() == [0, 0, 0]
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 2\)"):
        label_histogram(labels, np.arange(6), num_classes=2)


@pytest.mark.parametrize(
    "call,match",
    [
        (lambda y: partition_iid(y, 0), "world_size must be >= 1"),
        (lambda y: partition_iid(y, 2.0), "world_size must be an integer"),
        (lambda y: partition_iid(y, 11), r"world_size \(11\) exceeds"),
        (lambda y: partition_dirichlet(y, 0, 0.5), "world_size"),
        (lambda y: partition_dirichlet(y, 2, 0.0), "alpha"),
        (lambda y: partition_dirichlet(y, 2, -1.0), "alpha"),
        (lambda y: partition_dirichlet(y, 2, float("nan")), "alpha"),
        (lambda y: partition_dirichlet(y, 2, "x"), "alpha"),
        (lambda y: partition_iid(y.reshape(2, 5), 2), "labels must be 1-D"),
    ],
)
def test_partition_bad_parameters(call, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(np.arange(10) % 3)
