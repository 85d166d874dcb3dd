"""Sparse messages: pack (values, int32 indices) into one byte buffer and back.

AG-Topk sends values and indices in *one* allgather: one latency term instead of two.
The buffer is ``k`` values in the gradient's dtype followed by ``k`` int32 indices.
"""

from __future__ import annotations

import torch

INDEX_DTYPE = torch.int32
INDEX_BYTES = 4
#: The largest bucket a sparse exchange can address with int32 indices.
MAX_SPARSE_NUMEL = torch.iinfo(INDEX_DTYPE).max + 1


def check_index_range(numel: int) -> None:
    """Raise unless int32 indices can address every element of a ``numel``-element bucket.

    Past 2^31 elements a cast to int32 wraps around silently: values would land on the
    wrong parameters.
    """
    if numel > MAX_SPARSE_NUMEL:
        raise ValueError(
            f"a DDP bucket of {numel} elements is too large for flexcomm's int32 sparse indices (at most "
            f"{MAX_SPARSE_NUMEL}); lower DDP's bucket_cap_mb so that no bucket exceeds that"
        )


def pack(values: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """One uint8 buffer holding ``values`` then ``indices`` (both length k)."""
    if values.numel() != indices.numel():
        raise ValueError(f"{values.numel()} values but {indices.numel()} indices")
    return torch.cat([values.contiguous().view(torch.uint8), indices.to(INDEX_DTYPE).contiguous().view(torch.uint8)])


def unpack_all(gathered: torch.Tensor, world_size: int, k: int, value_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Split an allgathered buffer of ``world_size`` messages into all values and all indices."""
    messages = gathered.view(world_size, -1)
    split = k * _itemsize(value_dtype)
    values = messages[:, :split].contiguous().view(value_dtype).flatten()
    indices = messages[:, split:].contiguous().view(INDEX_DTYPE).flatten()
    return values, indices


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
