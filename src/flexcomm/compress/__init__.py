"""Compression: pure tensor math (selection, packing, error-feedback memory). No communication."""

from flexcomm.compress.memory import ResidualMemory
from flexcomm.compress.mstopk import mstopk_indices
from flexcomm.compress.sparse import pack, unpack_all
from flexcomm.compress.topk import TopkWorkspace, k_for, topk_indices

__all__ = [
    "ResidualMemory",
    "TopkWorkspace",
    "k_for",
    "mstopk_indices",
    "pack",
    "topk_indices",
    "unpack_all",
]
