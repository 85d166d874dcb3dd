"""Where the training app's images come from, and how they become tensors. Nothing is downloaded.

Sources:

* IDX files (MNIST / Fashion-MNIST format, gzip or plain): :func:`read_idx`,
  :func:`load_idx_dataset`. The default directory is where Debian's
  ``dataset-fashion-mnist`` package installs Fashion-MNIST.
* :func:`synthetic_dataset`: a small learnable set for tests and CI.
* Users' own data: :func:`load_npz_dataset` (``.npz`` with ``x`` and ``y``) and
  :func:`load_image_folder` (one sub-directory per class; needs Pillow, which
  matplotlib already depends on).

Image arrays are ``(N, H, W)`` (single channel) or ``(N, C, H, W)``;
:func:`to_tensor_dataset` turns either into normalised float32 NCHW tensors.
Labels are int64 class indices ``0..num_classes-1``.  How samples are split among
ranks is :mod:`flexcomm.train.partition`; what one rank of a run gets is
:mod:`flexcomm.train.rank_data`.
"""

from __future__ import annotations

import gzip
import math
import zlib
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import TensorDataset

__all__ = [
    "DEFAULT_DATA_DIR",
    "compute_mean_std",
    "load_idx_dataset",
    "load_image_folder",
    "load_npz_dataset",
    "read_idx",
    "synthetic_dataset",
    "to_tensor_dataset",
]

DEFAULT_DATA_DIR = Path("/usr/share/datasets/fashion-mnist")

# IDX type byte -> big-endian numpy dtype.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype("u1"),
    0x09: np.dtype("i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_GZIP_MAGIC = b"\x1f\x8b"

_IMAGE_SUFFIXES = frozenset(
    {".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm"}
)


# ----------------------------------------------------------------------------- IDX


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (gzip-compressed or plain, detected from its content).

    Returns an array in native byte order with the shape stored in the header.
    Raises ``ValueError`` for a bad magic number, an unknown type code, or a file
    whose length does not match its header (truncated or with trailing bytes).
    """
    path = Path(path)
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == _GZIP_MAGIC:
        try:
            raw = gzip.decompress(raw)
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise ValueError(f"{path}: corrupt or truncated gzip data ({exc})") from exc
    if len(raw) < 4:
        raise ValueError(f"{path}: truncated IDX file ({len(raw)} bytes, no header)")
    if raw[0] != 0 or raw[1] != 0:
        raise ValueError(
            f"{path}: bad IDX magic number 0x{raw[:4].hex()} "
            "(expected two zero bytes, a type code and a dimension count)"
        )
    type_code, ndim = raw[2], raw[3]
    if type_code not in _IDX_DTYPES:
        raise ValueError(
            f"{path}: bad IDX magic number, unknown type code 0x{type_code:02x}"
        )
    if ndim == 0:
        raise ValueError(f"{path}: IDX header declares 0 dimensions")
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(
            f"{path}: truncated IDX file (header needs {header_len} bytes, got {len(raw)})"
        )
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[type_code]
    expected = header_len + math.prod(shape) * dtype.itemsize
    if len(raw) < expected:
        raise ValueError(
            f"{path}: truncated IDX file (shape {shape} needs {expected} bytes, "
            f"got {len(raw)})"
        )
    if len(raw) > expected:
        raise ValueError(
            f"{path}: {len(raw) - expected} unexpected trailing bytes after IDX data "
            f"of shape {shape}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


def _find_idx_file(data_dir: Path, stem: str) -> Path:
    for name in (stem, stem + ".gz"):
        if (data_dir / name).is_file():
            return data_dir / name
    raise FileNotFoundError(f"{data_dir}: neither {stem} nor {stem}.gz found")


def load_idx_dataset(
    data_dir: str | Path | None = None, train: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """Load an MNIST-format split: ``(images uint8 [N, H, W], labels int64 [N])``.

    Looks for ``train-images-idx3-ubyte[.gz]`` / ``train-labels-idx1-ubyte[.gz]``
    (or the ``t10k-`` files when ``train`` is false) in ``data_dir``, which
    defaults to :data:`DEFAULT_DATA_DIR` (Fashion-MNIST from Debian).
    """
    data_dir = DEFAULT_DATA_DIR if data_dir is None else Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(
            f"dataset directory {data_dir} does not exist; install Fashion-MNIST with "
            "`apt-get install dataset-fashion-mnist` or pass --data-dir pointing to "
            "a directory with MNIST-format IDX files"
        )
    prefix = "train" if train else "t10k"
    images = read_idx(_find_idx_file(data_dir, f"{prefix}-images-idx3-ubyte"))
    labels = read_idx(_find_idx_file(data_dir, f"{prefix}-labels-idx1-ubyte"))
    if images.ndim != 3 or images.dtype != np.uint8:
        raise ValueError(
            f"{data_dir}: expected uint8 images of shape (N, H, W), "
            f"got {images.dtype} {images.shape}"
        )
    _check_label_shape(labels, len(images), str(data_dir))
    return images, labels.astype(np.int64)


# ----------------------------------------------------------------------- synthetic


def synthetic_dataset(
    n: int,
    num_classes: int = 10,
    image_size: int = 28,
    channels: int = 1,
    seed: int = 0,
    noise: float = 0.25,
) -> tuple[np.ndarray, np.ndarray]:
    """A learnable synthetic classification set: ``(uint8 [N, C, H, W], int64 [N])``.

    Each class has a random blocky template (a 4x4 grid per channel, upsampled to
    ``image_size``); a sample is its class template plus Gaussian pixel noise of
    standard deviation ``noise`` (in units of the [0, 1] intensity range). Classes
    are balanced (sizes differ by at most one) and shuffled; the result depends only
    on the arguments.
    """
    sizes = dict(n=n, num_classes=num_classes, image_size=image_size, channels=channels)
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if noise < 0:
        raise ValueError(f"noise must be >= 0, got {noise}")
    rng = np.random.default_rng(seed)
    grid = 4
    coarse = rng.uniform(0.15, 0.85, size=(num_classes, channels, grid, grid))
    cells = np.arange(image_size) * grid // image_size
    templates = coarse[:, :, cells][:, :, :, cells]  # (classes, C, H, W)
    labels = rng.permutation(np.arange(n) % num_classes).astype(np.int64)
    noise_field = rng.normal(0.0, noise, size=(n, channels, image_size, image_size))
    pixels = templates[labels] + noise_field
    images = np.clip(np.rint(pixels * 255.0), 0, 255).astype(np.uint8)
    return images, labels


# ----------------------------------------------------------------------- user data


def _check_label_shape(labels: np.ndarray, n_images: int, source: str) -> None:
    """One label per image, in a 1-D array."""
    if labels.ndim != 1 or len(labels) != n_images:
        raise ValueError(
            f"{source}: {n_images} images but labels of shape {labels.shape}; "
            f"labels must have shape ({n_images},)"
        )


def _check_images_labels(images: np.ndarray, labels: np.ndarray, source: str) -> None:
    if images.ndim not in (3, 4):
        raise ValueError(
            f"{source}: images must have shape (N, H, W) or (N, C, H, W), "
            f"got {images.shape}"
        )
    _check_label_shape(labels, len(images), source)
    if not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"{source}: labels must be integers, got {labels.dtype}")
    if labels.size and labels.min() < 0:
        raise ValueError(f"{source}: labels must be >= 0, got {labels.min()}")


def load_npz_dataset(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """Load ``(images, labels int64)`` from a ``.npz`` with arrays ``x`` and ``y``.

    ``x`` has shape (N, H, W) or (N, C, H, W) (uint8 0..255 or float); ``y`` holds
    N non-negative integer class indices.
    """
    path = Path(path)
    with np.load(path, allow_pickle=False) as archive:
        missing = {"x", "y"} - set(archive.files)
        if missing:
            raise ValueError(
                f"{path}: missing array(s) {sorted(missing)}; found {archive.files}"
            )
        images, labels = archive["x"], archive["y"]
    _check_images_labels(images, labels, str(path))
    return images, labels.astype(np.int64)


def load_image_folder(
    root: str | Path, channels: int = 3, image_size: int | None = None
) -> tuple[np.ndarray, np.ndarray, list[str]]:
    """Load a class-per-subdirectory image folder (requires Pillow).

    Sub-directories of ``root``, sorted by name, are the classes; their image files
    (png, jpg, bmp, gif, tiff, webp, pgm/ppm) are converted to ``channels`` (1 =
    grayscale, 3 = RGB) and, if ``image_size`` is given, resized to that square
    size; otherwise all images must already share one size. Returns
    ``(images uint8 [N, C, H, W], labels int64 [N], class_names)``.
    """
    try:
        from PIL import Image
    except ImportError as exc:  # pragma: no cover - Pillow ships with matplotlib
        raise ImportError(
            "load_image_folder needs Pillow (pip install pillow); "
            "alternatively convert the data to an .npz with arrays x and y"
        ) from exc
    if channels not in (1, 3):
        raise ValueError(f"channels must be 1 or 3, got {channels}")
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {root} does not exist")
    class_dirs = sorted(p for p in root.iterdir() if p.is_dir())
    if not class_dirs:
        raise ValueError(f"{root}: no class sub-directories found")
    mode = "L" if channels == 1 else "RGB"
    images: list[np.ndarray] = []
    labels: list[int] = []
    for label, class_dir in enumerate(class_dirs):
        for file in sorted(class_dir.iterdir()):
            if file.suffix.lower() not in _IMAGE_SUFFIXES:
                continue
            with Image.open(file) as img:
                img = img.convert(mode)
                if image_size is not None:
                    img = img.resize((image_size, image_size), Image.Resampling.BILINEAR)
                array = np.asarray(img, dtype=np.uint8)
            if images and array.shape != images[0].shape:
                raise ValueError(
                    f"{file}: size {array.shape[:2]} differs from {images[0].shape[:2]}; "
                    "pass image_size to resize"
                )
            images.append(array)
            labels.append(label)
    if not images:
        raise ValueError(f"{root}: no image files found in the class sub-directories")
    stacked = np.stack(images)
    stacked = stacked[:, None] if channels == 1 else stacked.transpose(0, 3, 1, 2)
    return np.ascontiguousarray(stacked), np.asarray(labels, dtype=np.int64), [
        d.name for d in class_dirs
    ]


# -------------------------------------------------------------------------- tensors


def _as_float_nchw(images: np.ndarray, dtype: type = np.float32) -> np.ndarray:
    """(N,H,W) or (N,C,H,W) -> float NCHW of ``dtype``; uint8 is scaled to [0, 1]."""
    if images.ndim == 3:
        images = images[:, None]
    elif images.ndim != 4:
        raise ValueError(
            f"images must have shape (N, H, W) or (N, C, H, W), got {images.shape}"
        )
    if images.dtype == np.uint8:
        return images.astype(dtype) / dtype(255)
    return images.astype(dtype)


def compute_mean_std(
    images: np.ndarray, chunk: int = 4096
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and standard deviation, on the scale used by
    :func:`to_tensor_dataset` (uint8 images are divided by 255)."""
    if len(images) == 0:
        raise ValueError("images is empty")
    total = sq_total = None
    count = 0
    for start in range(0, len(images), chunk):
        x = _as_float_nchw(images[start : start + chunk], np.float64)
        s, sq = x.sum(axis=(0, 2, 3)), (x * x).sum(axis=(0, 2, 3))
        total = s if total is None else total + s
        sq_total = sq if sq_total is None else sq_total + sq
        count += x.shape[0] * x.shape[2] * x.shape[3]
    mean = total / count
    std = np.sqrt(np.maximum(sq_total / count - mean**2, 0.0))
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def to_tensor_dataset(
    images: np.ndarray,
    labels: np.ndarray,
    mean: float | Sequence[float],
    std: float | Sequence[float],
) -> TensorDataset:
    """TensorDataset of ``(float32 [N, C, H, W], int64 [N])`` with
    ``x = (pixels - mean) / std`` per channel.

    uint8 pixels are first scaled to [0, 1], so ``mean``/``std`` are on that scale;
    each is a scalar or one value per channel (see :func:`compute_mean_std`).
    """
    x = _as_float_nchw(np.asarray(images))
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) != len(x):
        raise ValueError(f"labels must have shape ({len(x)},), got {labels.shape}")
    channels = x.shape[1]
    mean_arr = np.asarray(mean, dtype=np.float32).reshape(-1)
    std_arr = np.asarray(std, dtype=np.float32).reshape(-1)
    if mean_arr.size not in (1, channels) or std_arr.size not in (1, channels):
        raise ValueError(f"mean and std must be scalars or have {channels} values")
    mean_arr = np.broadcast_to(mean_arr, (channels,))
    std_arr = np.broadcast_to(std_arr, (channels,))
    if not np.all(std_arr > 0):
        raise ValueError(f"std must be > 0, got {std}")
    x = (x - mean_arr[:, None, None]) / std_arr[:, None, None]
    return TensorDataset(torch.from_numpy(x), torch.from_numpy(labels.astype(np.int64)))
