"""Bit-for-bit comparison of checkpoint states (nested dicts, lists, tensors, numbers)."""

from __future__ import annotations

import math
from typing import Any

import torch


def assert_same_state(a: Any, b: Any) -> None:
    """Equal bit for bit: tensors by value and dtype, containers element by element, NaN equals NaN."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys()
        for key in a:
            assert_same_state(a[key], b[key])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            assert_same_state(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert isinstance(b, float) and math.isnan(b)
    else:
        assert a == b
