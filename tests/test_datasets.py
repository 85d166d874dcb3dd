"""Tests for flexcomm.train.datasets: IDX reading, data sources and tensors."""

from __future__ import annotations

import gzip
from pathlib import Path

import numpy as np
import pytest
import torch

from flexcomm.train.datasets import (
    DEFAULT_DATA_DIR,
    compute_mean_std,
    load_idx_dataset,
    load_image_folder,
    load_npz_dataset,
    read_idx,
    synthetic_dataset,
    to_tensor_dataset,
)

IDX_TYPE_CODES = {np.dtype("u1"): 0x08, np.dtype("i4"): 0x0C, np.dtype("f4"): 0x0D}


def idx_bytes(array: np.ndarray) -> bytes:
    """Encode ``array`` in the IDX format: magic, big-endian dims, big-endian data."""
    magic = bytes([0, 0, IDX_TYPE_CODES[array.dtype], array.ndim])
    dims = np.asarray(array.shape, dtype=">u4").tobytes()
    return magic + dims + array.astype(array.dtype.newbyteorder(">")).tobytes()


def write_idx(path: Path, array: np.ndarray, compress: bool) -> Path:
    data = idx_bytes(array)
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


# ----------------------------------------------------------------------------- IDX


@pytest.mark.parametrize("compress", [False, True])
@pytest.mark.parametrize(
    "array",
    [
        np.arange(2 * 3 * 5, dtype=np.uint8).reshape(2, 3, 5),
        np.array([-7, 0, 65536, 2**31 - 1], dtype=np.int32),
        np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4),
    ],
    ids=["uint8-3d", "int32-1d", "float32-2d"],
)
def test_idx_round_trip(tmp_path: Path, array: np.ndarray, compress: bool) -> None:
    out = read_idx(write_idx(tmp_path / "a.idx", array, compress))
    assert out.shape == array.shape
    assert out.dtype == array.dtype  # native byte order, same kind
    np.testing.assert_array_equal(out, array)


def test_idx_bad_magic(tmp_path: Path) -> None:
    data = bytearray(idx_bytes(np.zeros((2, 2), np.uint8)))
    data[0] = 0x1A
    (tmp_path / "bad").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="bad IDX magic"):
        read_idx(tmp_path / "bad")
    data[0] = 0
    data[2] = 0x42  # unknown type code
    (tmp_path / "bad").write_bytes(bytes(data))
    with pytest.raises(ValueError, match="unknown type code 0x42"):
        read_idx(tmp_path / "bad")


@pytest.mark.parametrize("cut", [2, 9, 12 + 5])  # inside magic, inside dims, inside data
@pytest.mark.parametrize("compress", [False, True])
def test_idx_truncated(tmp_path: Path, cut: int, compress: bool) -> None:
    data = idx_bytes(np.ones((2, 3), np.uint8))[:cut]  # full length is 4 + 8 + 6
    path = tmp_path / "t"
    path.write_bytes(gzip.compress(data) if compress else data)
    with pytest.raises(ValueError, match="truncated"):
        read_idx(path)


def test_idx_truncated_gzip_stream(tmp_path: Path) -> None:
    blob = gzip.compress(idx_bytes(np.arange(100, dtype=np.uint8)))
    (tmp_path / "t.gz").write_bytes(blob[: len(blob) // 2])
    with pytest.raises(ValueError, match="truncated gzip"):
        read_idx(tmp_path / "t.gz")


def test_idx_trailing_bytes(tmp_path: Path) -> None:
    (tmp_path / "x").write_bytes(idx_bytes(np.ones(4, np.uint8)) + b"\0\0")
    with pytest.raises(ValueError, match="2 unexpected trailing bytes"):
        read_idx(tmp_path / "x")


def test_load_idx_dataset_from_directory(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    train_x = rng.integers(0, 256, size=(6, 28, 28), dtype=np.uint8)
    test_x = rng.integers(0, 256, size=(4, 28, 28), dtype=np.uint8)
    write_idx(tmp_path / "train-images-idx3-ubyte", train_x, compress=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.arange(6, dtype=np.uint8), False)
    write_idx(tmp_path / "t10k-images-idx3-ubyte.gz", test_x, compress=True)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte.gz", np.array([9, 0, 1, 2], np.uint8), True)

    x, y = load_idx_dataset(tmp_path, train=True)
    np.testing.assert_array_equal(x, train_x)
    assert y.dtype == np.int64 and y.tolist() == [0, 1, 2, 3, 4, 5]
    x, y = load_idx_dataset(tmp_path, train=False)
    np.testing.assert_array_equal(x, test_x)
    assert y.tolist() == [9, 0, 1, 2]


def test_load_idx_dataset_label_count_mismatch(tmp_path: Path) -> None:
    write_idx(tmp_path / "train-images-idx3-ubyte", np.zeros((3, 4, 4), np.uint8), False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(2, np.uint8), False)
    with pytest.raises(ValueError, match="3 images but labels of shape"):
        load_idx_dataset(tmp_path)


def test_load_idx_dataset_missing(tmp_path: Path) -> None:
    expected = "apt-get install dataset-fashion-mnist.*--data-dir"
    with pytest.raises(FileNotFoundError, match=expected):
        load_idx_dataset(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="t10k-images-idx3-ubyte"):
        load_idx_dataset(tmp_path, train=False)


@pytest.mark.skipif(
    not DEFAULT_DATA_DIR.is_dir(),
    reason=f"{DEFAULT_DATA_DIR} absent (apt-get install dataset-fashion-mnist)",
)
def test_real_fashion_mnist() -> None:
    x, y = load_idx_dataset(train=True)
    assert x.shape == (60000, 28, 28) and x.dtype == np.uint8
    assert y.shape == (60000,) and y.dtype == np.int64
    assert y.min() == 0 and y.max() == 9
    assert np.bincount(y).tolist() == [6000] * 10
    x_test, y_test = load_idx_dataset(DEFAULT_DATA_DIR, train=False)
    assert x_test.shape == (10000, 28, 28) and set(np.unique(y_test)) == set(range(10))


# ----------------------------------------------------------------------- synthetic


def test_synthetic_dataset_shape_balance_determinism() -> None:
    x, y = synthetic_dataset(103, num_classes=10, image_size=32, channels=3, seed=5)
    assert x.shape == (103, 3, 32, 32) and x.dtype == np.uint8
    assert y.dtype == np.int64 and np.bincount(y).tolist() == [11, 11, 11] + [10] * 7
    x2, y2 = synthetic_dataset(103, num_classes=10, image_size=32, channels=3, seed=5)
    np.testing.assert_array_equal(x, x2)
    np.testing.assert_array_equal(y, y2)
    x3, _ = synthetic_dataset(103, num_classes=10, image_size=32, channels=3, seed=6)
    assert not np.array_equal(x, x3)


def test_synthetic_dataset_is_learnable() -> None:
    """A nearest-class-mean classifier fitted on one half classifies the other half."""
    x, y = synthetic_dataset(1000, num_classes=10, image_size=28, channels=1, seed=0)
    feats = x.reshape(len(x), -1).astype(np.float64)
    fit, held = slice(0, 500), slice(500, None)
    centroids = np.stack([feats[fit][y[fit] == c].mean(axis=0) for c in range(10)])
    dists = ((feats[held, None, :] - centroids[None]) ** 2).sum(axis=-1)
    accuracy = (dists.argmin(axis=1) == y[held]).mean()
    assert accuracy > 0.9  # chance is 0.1
    # ...and the noise is real: samples of one class are not identical.
    assert len(np.unique(feats[y == 0], axis=0)) == (y == 0).sum()


def test_synthetic_dataset_bad_arguments() -> None:
    with pytest.raises(ValueError, match="num_classes"):
        synthetic_dataset(10, num_classes=0)
    with pytest.raises(ValueError, match="noise"):
        synthetic_dataset(10, noise=-1.0)


# ----------------------------------------------------------------------- user data


def test_npz_round_trip(tmp_path: Path) -> None:
    x = np.random.default_rng(0).random((5, 3, 8, 8)).astype(np.float32)
    y = np.array([0, 2, 1, 2, 0], dtype=np.int32)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    xl, yl = load_npz_dataset(tmp_path / "d.npz")
    np.testing.assert_array_equal(xl, x)
    assert yl.dtype == np.int64 and yl.tolist() == y.tolist()


@pytest.mark.parametrize(
    "arrays,match",
    [
        ({"x": np.zeros((2, 4, 4))}, r"missing array\(s\) \['y'\]"),
        ({"x": np.zeros((2, 4)), "y": np.zeros(2, int)}, "images must have shape"),
        ({"x": np.zeros((2, 4, 4)), "y": np.zeros(3, int)}, r"labels must have shape \(2,\)"),
        ({"x": np.zeros((2, 4, 4)), "y": np.zeros(2)}, "labels must be integers"),
        ({"x": np.zeros((2, 4, 4)), "y": np.array([0, -1])}, "labels must be >= 0"),
    ],
)
def test_npz_errors(tmp_path: Path, arrays: dict, match: str) -> None:
    np.savez(tmp_path / "d.npz", **arrays)
    with pytest.raises(ValueError, match=match):
        load_npz_dataset(tmp_path / "d.npz")


def test_image_folder(tmp_path: Path) -> None:
    Image = pytest.importorskip("PIL.Image")
    rng = np.random.default_rng(0)
    written = {}
    for cls, count in (("cat", 2), ("dog", 3)):
        (tmp_path / cls).mkdir()
        for i in range(count):
            pixels = rng.integers(0, 256, size=(6, 5, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(tmp_path / cls / f"{i}.png")
            written[(cls, i)] = pixels
    (tmp_path / "dog" / "notes.txt").write_text("ignored")

    x, y, names = load_image_folder(tmp_path, channels=3)
    assert names == ["cat", "dog"]
    assert x.shape == (5, 3, 6, 5) and x.dtype == np.uint8
    assert y.tolist() == [0, 0, 1, 1, 1]
    np.testing.assert_array_equal(x[2], written[("dog", 0)].transpose(2, 0, 1))

    gray, _, _ = load_image_folder(tmp_path, channels=1, image_size=4)
    assert gray.shape == (5, 1, 4, 4)

    Image.fromarray(np.zeros((7, 7, 3), np.uint8)).save(tmp_path / "cat" / "big.png")
    with pytest.raises(ValueError, match="pass image_size"):
        load_image_folder(tmp_path)
    with pytest.raises(ValueError, match="channels must be 1 or 3"):
        load_image_folder(tmp_path, channels=2)


# -------------------------------------------------------------------------- tensors


def test_to_tensor_dataset_single_channel() -> None:
    images = np.array([[[0, 255], [51, 102]]], dtype=np.uint8)  # (1, 2, 2)
    ds = to_tensor_dataset(images, np.array([3]), mean=0.2, std=0.5)
    x, y = ds.tensors
    assert x.dtype == torch.float32 and x.shape == (1, 1, 2, 2)
    assert y.dtype == torch.int64 and y.tolist() == [3]
    expected = (np.array([[0, 1], [0.2, 0.4]]) - 0.2) / 0.5
    np.testing.assert_allclose(x[0, 0].numpy(), expected, atol=1e-6)


def test_to_tensor_dataset_per_channel_stats() -> None:
    images, labels = synthetic_dataset(50, num_classes=5, image_size=8, channels=3, seed=1)
    mean, std = compute_mean_std(images)
    direct = images.astype(np.float64) / 255.0
    np.testing.assert_allclose(mean, direct.mean(axis=(0, 2, 3)), rtol=1e-9)
    np.testing.assert_allclose(std, direct.std(axis=(0, 2, 3)), rtol=1e-6)
    np.testing.assert_allclose(compute_mean_std(images, chunk=7), (mean, std), rtol=1e-9)

    x, _ = to_tensor_dataset(images, labels, mean, std).tensors
    assert x.shape == (50, 3, 8, 8)
    np.testing.assert_allclose(x.mean(dim=(0, 2, 3)).numpy(), 0.0, atol=1e-5)
    np.testing.assert_allclose(x.std(dim=(0, 2, 3), correction=0).numpy(), 1.0, atol=1e-5)


def test_to_tensor_dataset_errors() -> None:
    images = np.zeros((2, 3, 4, 4), np.uint8)
    with pytest.raises(ValueError, match="std must be > 0"):
        to_tensor_dataset(images, np.zeros(2), 0.0, 0.0)
    with pytest.raises(ValueError, match="3 values"):
        to_tensor_dataset(images, np.zeros(2), (0.5, 0.5), 1.0)
    with pytest.raises(ValueError, match=r"labels must have shape \(2,\)"):
        to_tensor_dataset(images, np.zeros(3), 0.5, 1.0)
