"""Random delays for ordering tests: buckets that reach the hook at rank-dependent times."""

from __future__ import annotations

import time

import torch


class SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: buckets reach the hook at rank-dependent times."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, delay: float) -> torch.Tensor:
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.delay)
        return grad, None
