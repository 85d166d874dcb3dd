"""flexcomm.accelerate.register in real 2-rank Accelerate runs on CPU/gloo: save_state / load_state keep every rank's state."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

accelerate = pytest.importorskip("accelerate", reason="needs the accelerate extra: pip install flexcomm[accelerate]")

import flexcomm.accelerate  # noqa: E402
from multiproc import run_world  # noqa: E402
from same_state import assert_same_state  # noqa: E402

STEPS = 4


def _accelerator(rank: int, world_size: int) -> Any:
    # Started as torchrun would; the process group already exists, so Accelerate joins it.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    return accelerate.Accelerator(cpu=True)


def _model_and_optimizer(accelerator: Any) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return accelerator.prepare(model, optimizer)


def _train(accelerator: Any, model: nn.Module, optimizer: torch.optim.Optimizer, rank: int) -> None:
    generator = torch.Generator().manual_seed(rank)  # each rank its own data: residuals differ
    for _ in range(STEPS):
        x, y = torch.randn(16, 20, generator=generator), torch.randint(0, 4, (16,), generator=generator)
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()


def _save_then_load(rank: int, world_size: int, out: str) -> dict[str, Any]:
    accelerator = _accelerator(rank, world_size)
    model, optimizer = _model_and_optimizer(accelerator)
    state = flexcomm.accelerate.register(accelerator, model, compressor="agtopk", density=0.05)
    _train(accelerator, model, optimizer, rank)
    accelerator.save_state(out)
    saved = state.state_dict()
    accelerator.wait_for_everyone()  # the main process has written the files

    restarted = _accelerator(rank, world_size)  # a fresh job, as after a restart
    model, optimizer = _model_and_optimizer(restarted)
    fresh = flexcomm.accelerate.register(restarted, model, compressor="agtopk", density=0.05)
    restarted.load_state(out)
    return {"saved": saved, "loaded": fresh.state_dict()}


def test_save_and_load_state_give_every_rank_its_own(tmp_path: Path) -> None:
    results = run_world(_save_then_load, 2, str(tmp_path / "checkpoint"))
    for result in results:
        assert result["saved"]["step"] == STEPS
        assert_same_state(result["loaded"], result["saved"])
    with pytest.raises(AssertionError):  # the ranks' residuals differ: a mix-up would be seen
        assert_same_state(results[0]["saved"]["memory"], results[1]["saved"]["memory"])


def _register_before_prepare(rank: int, world_size: int) -> str:
    accelerator = _accelerator(rank, world_size)
    try:
        flexcomm.accelerate.register(accelerator, nn.Linear(2, 2), compressor="agtopk")
    except TypeError as exc:
        return str(exc)
    return "no error"


def test_register_before_prepare_says_so() -> None:
    for message in run_world(_register_before_prepare, 2):
        assert "call it after prepare" in message and "Linear" in message
