"""Compression: pure tensor math (selection, packing, error-feedback memory, statistics). No communication."""

from flexcomm.compress.memory import Layout, ResidualMemory
from flexcomm.compress.mstopk import mstopk_indices
from flexcomm.compress.selectors import SELECTORS, Selector, make_selector
from flexcomm.compress.sparse import check_index_range, pack, unpack_all
from flexcomm.compress.topk import TopkWorkspace, k_for, topk_indices

__all__ = [
    "SELECTORS",
    "Layout",
    "ResidualMemory",
    "Selector",
    "TopkWorkspace",
    "check_index_range",
    "k_for",
    "make_selector",
    "mstopk_indices",
    "pack",
    "topk_indices",
    "unpack_all",
]
