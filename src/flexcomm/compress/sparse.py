"""Sparse messages: pack (values, int32 indices) into one byte buffer and back.

AG-Topk sends values and indices in *one* allgather: one latency term instead of two.
The buffer is ``k`` values in the gradient's dtype followed by ``k`` int32 indices.
"""

from __future__ import annotations

import torch

INDEX_DTYPE = torch.int32
INDEX_BYTES = 4


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
