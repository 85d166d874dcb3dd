"""The hook beside other collectives on DDP's group: DDP's own, a second model's, another subgroup's.

``flexcomm.register`` gives the hook a process group of its own.  Without it these runs
crashed on gloo ("Received data size doesn't match expected size"): DDP with
``find_unused_parameters=True`` allreduces its used-parameter map from the autograd thread
while the dispatcher thread still issues bucket collectives, and two hooked models (or a
hooked and a plain one) in one backward pass issue from two threads on one group.
Each run must finish with every replica equal, bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from multiproc import run_world

STEPS = 12
SMALL_BUCKETS_MB = 0.01  # several buckets per model, so collectives of one step can interleave


class Branchy(nn.Module):
    """Layers of 64 units; ``b`` is skipped when ``use_b`` is False (an unused parameter for DDP)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.out = nn.Linear(64, 64), nn.Linear(64, 64), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor, use_b: bool = True) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if use_b:
            h = torch.relu(self.b(h))
        return self.out(h)


def train(models: list[DDP], rank: int, skip_b_every: int = 0) -> list[list[torch.Tensor]]:
    """``STEPS`` SGD steps of the summed loss of ``models``; the parameters of each after them."""
    optimizer = torch.optim.SGD([p for m in models for p in m.parameters()], lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for step in range(STEPS):
        x = torch.randn(8, 64, generator=gen)
        use_b = not (skip_b_every and step % skip_b_every == 0)
        loss = sum(m(x, use_b).square().mean() for m in models)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return [[p.detach().clone() for p in m.module.parameters()] for m in models]


def model(seed: int, **ddp_args) -> DDP:
    torch.manual_seed(seed)
    return DDP(Branchy(), bucket_cap_mb=SMALL_BUCKETS_MB, **ddp_args)


def _unused_parameters(rank: int, world: int, compressor: str) -> list[list[torch.Tensor]]:
    ddp = model(0, find_unused_parameters=True)
    flexcomm.register(ddp, compressor=compressor, density=0.1)
    return train([ddp], rank, skip_b_every=3)


def _two_models(rank: int, world: int, second_hooked: bool) -> list[list[torch.Tensor]]:
    first, second = model(0), model(1)
    flexcomm.register(first, compressor="flex", density=0.1)
    if second_hooked:
        flexcomm.register(second, compressor="artopk-star", density=0.1)
    return train([first, second], rank)


def _subgroups(rank: int, world: int) -> list[list[torch.Tensor]]:
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    ddp = model(0, process_group=halves[rank // 2])
    state = flexcomm.register(ddp, compressor="flex", density=0.1)
    assert state.world_size == 2
    return train([ddp], rank)


def assert_replicas_equal(results: list, groups: list[tuple[int, ...]]) -> None:
    for group in groups:
        first = results[group[0]]
        for other in group[1:]:
            for params_a, params_b in zip(first, results[other]):
                assert all(torch.equal(a, b) for a, b in zip(params_a, params_b)), f"ranks {group[0]} and {other} differ"


@pytest.mark.parametrize("compressor", ["artopk-star", "agtopk", "flex"])
def test_find_unused_parameters(compressor: str) -> None:
    assert_replicas_equal(run_world(_unused_parameters, 2, compressor, timeout_s=30), [(0, 1)])


@pytest.mark.parametrize("second_hooked", [True, False], ids=["both-hooked", "second-plain-ddp"])
def test_two_models_in_one_backward(second_hooked: bool) -> None:
    assert_replicas_equal(run_world(_two_models, 2, second_hooked, timeout_s=30), [(0, 1)])


def test_models_on_two_subgroups() -> None:
    assert_replicas_equal(run_world(_subgroups, 4, timeout_s=30), [(0, 1), (2, 3)])


def _own_group_timeout(rank: int, world: int) -> float:
    ddp = model(0)
    state = flexcomm.register(ddp, compressor="flex", density=0.1)
    backend = state.process_group._get_backend(torch.device("cpu"))
    return backend.options._timeout.total_seconds()


def test_the_hook_s_own_group_keeps_the_job_s_timeout() -> None:
    # A dead peer must be detected as soon as on DDP's group (run_world sets 17 s), not
    # after the backend's default of many minutes.
    assert run_world(_own_group_timeout, 2, timeout_s=17) == [17.0, 17.0]


def _app_state_group(rank: int, world: int) -> bool:
    from flexcomm.train.config import TrainConfig
    from flexcomm.train.timed_hook import TimedHook

    state = TimedHook(TrainConfig(compressor="flex", density="auto")).state
    return state.process_group is not None and state.process_group != dist.group.WORLD


def test_the_training_app_gives_its_hook_a_group_of_its_own() -> None:
    # flex's agreement allreduce is issued when a step's last bucket is; on DDP's group it raced
    # DDP's BatchNorm buffer broadcast at the next forward (seen: ResNet-18 on emulated hosts,
    # "Received data size doesn't match expected size. 4800 vs 160").
    assert run_world(_app_state_group, 2) == [True, True]
