"""Selectors: which indices of ``a`` a rank sends, by magnitude.

A selector is ``select(a, k, workspace) -> int32 indices`` (at most ``k`` of them):

``topk``    exact top-k of ``|a|`` (:func:`flexcomm.compress.topk.topk_indices`);
``mstopk``  about k large magnitudes by MSTopk's multi-round threshold search
            (:func:`flexcomm.compress.mstopk.mstopk_indices`), the costly baseline.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from flexcomm.compress.mstopk import mstopk_indices
from flexcomm.compress.topk import TopkWorkspace, topk_indices

Selector = Callable[[torch.Tensor, int, TopkWorkspace], torch.Tensor]
SELECTORS = ("topk", "mstopk")


def make_selector(name: str, mstopk_rounds: int) -> Selector:
    """The selector called ``name`` (one of :data:`SELECTORS`)."""
    if name == "topk":
        return topk_indices
    if name == "mstopk":
        return partial(_mstopk, rounds=mstopk_rounds)
    raise ValueError(f"selector must be one of {', '.join(SELECTORS)}; got {name!r}")


def _mstopk(a: torch.Tensor, k: int, workspace: TopkWorkspace, rounds: int) -> torch.Tensor:
    return mstopk_indices(a, k, rounds)
