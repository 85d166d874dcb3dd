"""What keeps the hook correct and fast on GPUs, checked on CPU where it can be caught here.

No host synchronisation per bucket, fp32 residuals for half-precision gradients, DDP's
divide-before-sum, one ``index_add_`` per source rank, the int32 index guard, and the
dispatcher thread taking its CUDA device from the bucket.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from flexcomm.comm import ExchangeStreams, clock, exchange_context
from flexcomm.compress import check_index_range
from flexcomm.compress.sparse import MAX_SPARSE_NUMEL
from flexcomm.control import DensityController
from flexcomm.rank_states import has_cpu_backend
from multiproc import run_world

SYNCING = ("item", "tolist", "__bool__", "__float__", "__int__", "nonzero")
LAYERS = 8


def _sync_count(rank: int, world: int, compressor: str, density: float | str) -> dict:
    """Host reads of tensor values during 20 steady-state steps of an 8-bucket model (``density="auto"``:
    measuring the gain curve every other step)."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(64, 64) for _ in range(LAYERS)]), bucket_cap_mb=64 * 65 * 4 / 2**20)
    controller = DensityController(measure_every=2) if density == "auto" else None
    state = flexcomm.register(model, compressor=compressor, density=density, controller=controller)
    x = torch.randn(16, 64) + rank

    def step() -> None:
        model.zero_grad()
        model(x).square().mean().backward()

    for _ in range(12):  # bucket rebuild, calibration, first agreements
        step()
    state.drain_records()
    calls: collections.Counter[str] = collections.Counter()
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}
    nonzero = torch.nonzero

    def counting(name, fn):
        def counted(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counting(name, fn))
    torch.nonzero = counting("torch.nonzero", nonzero)
    try:
        for _ in range(20):
            step()
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)
        torch.nonzero = nonzero
    buckets = len({rec.bucket for rec in state.drain_records()})
    return {"calls": dict(calls), "buckets": buckets}


@pytest.mark.parametrize("compressor,density", [
    ("dense", 1.0), ("agtopk", 0.05), ("mstopk", 0.05), ("artopk-star", 0.05), ("artopk-var", 0.05), ("flex", 0.05),
    ("lowrank", 0.05), ("flex", "auto"),
])
def test_no_host_sync_per_bucket_in_steady_state(compressor: str, density: float | str) -> None:
    # A read per bucket would be >= 8 per step (160 in 20 steps); the state reads the
    # step's device outcomes once per step, and flex its agreed measurements every 10 steps
    # (auto: with the summed gain curve, whose per-bucket energies stay on the device).  The
    # margin of 2 is for reads that follow timings, not buckets: flex + auto read 23 once in CI
    # on a loaded machine (cause not pinned down; 0 of 18 runs here: 6 idle and 6 under two busy
    # loops with this code, 6 under load with the code of a session before).
    for result in run_world(_sync_count, 2, compressor, density):
        assert result["buckets"] == LAYERS
        assert sum(result["calls"].values()) <= 20 + 2 + 2, result["calls"]


def _half_precision_residuals(rank: int, world: int, dtype: torch.dtype) -> dict:
    """One bf16/fp16 parameter; its gradient has one large element and small ones AR-Topk never sends."""
    weight = nn.Parameter(torch.zeros(64, dtype=dtype))
    model = DDP(_Linear(weight))
    state = flexcomm.register(model, compressor="artopk-star", density=1 / 64)
    grad = torch.full((64,), 1e-3, dtype=dtype)
    grad[0] = 100.0
    for _ in range(40):
        model.zero_grad()
        model(grad).backward()
    residual = state.memory.residual(0)
    return {"dtype": residual.dtype, "small": residual[1:].clone()}


class _Linear(nn.Module):
    """``loss = sum(w * g)``: the gradient of ``w`` is exactly ``g``."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, g: torch.Tensor) -> torch.Tensor:
        return (self.weight * g).sum()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_residuals_are_fp32_and_keep_small_values(dtype: torch.dtype) -> None:
    # 40 steps of 1e-3 (the bf16/fp16 value of it) summed in fp32; in bf16 the sum stalls
    # once 1e-3 falls below half an ulp of the residual (at 0.25-0.5 for bf16's 8 bits).
    small = torch.tensor(1e-3, dtype=dtype).float()
    expected = torch.zeros((), dtype=torch.float32)
    for _ in range(40):
        expected = expected + small
    for result in run_world(_half_precision_residuals, 2, dtype):
        assert result["dtype"] == torch.float32
        assert torch.equal(result["small"], expected.expand(63))


def _fp16_dense_near_the_top_of_the_range(rank: int, world: int) -> torch.Tensor:
    weight = nn.Parameter(torch.zeros(8, dtype=torch.float16))
    model = DDP(_Linear(weight))
    flexcomm.register(model, compressor="dense", density=1.0)
    model(torch.full((8,), 40_000.0, dtype=torch.float16)).backward()
    return weight.grad.clone()


def test_fp16_dense_divides_before_the_sum_as_ddp_does() -> None:
    # 40000 + 40000 overflows fp16 (max 65504); 20000 + 20000 does not.
    for grad in run_world(_fp16_dense_near_the_top_of_the_range, 2):
        assert torch.equal(grad, torch.full((8,), 40_000.0, dtype=torch.float16))


def _index_adds(rank: int, world: int) -> dict:
    # torch 2.13 deprecates all_gather_into_tensor: its warning would fail the exchange here.
    warnings.filterwarnings("error", message=".*all_gather_into_tensor.*is deprecated", category=FutureWarning)
    model = DDP(_Linear(nn.Parameter(torch.zeros(1000))))
    flexcomm.register(model, compressor="agtopk", density=0.05)
    calls: list[torch.Tensor] = []
    original = torch.Tensor.index_add_

    def spying(self, dim, index, source, *args, **kwargs):
        calls.append(index.clone())
        return original(self, dim, index, source, *args, **kwargs)

    torch.Tensor.index_add_ = spying
    try:
        model(torch.randn(1000, generator=torch.Generator().manual_seed(rank))).backward()
    finally:
        torch.Tensor.index_add_ = original
    return {"calls": calls}


def test_allgather_adds_one_source_rank_at_a_time_with_distinct_indices() -> None:
    # On CUDA one index_add_ over every rank's indices meets atomics at shared indices in
    # an unspecified order: replicas would drift bitwise.  Per source rank they never meet.
    for result in run_world(_index_adds, 4):
        assert len(result["calls"]) == 4
        for index in result["calls"]:
            assert index.numel() == 50 and index.unique().numel() == 50


def test_buckets_beyond_int32_indices_are_refused_with_advice() -> None:
    check_index_range(MAX_SPARSE_NUMEL)
    with pytest.raises(ValueError, match="too large for flexcomm's int32 sparse indices.*lower DDP's bucket_cap_mb"):
        check_index_range(MAX_SPARSE_NUMEL + 1)


def test_exchange_context_takes_the_device_from_the_bucket(monkeypatch: pytest.MonkeyPatch) -> None:
    # A dispatcher thread starts on CUDA device 0: without set_device every rank's control
    # tensors would land on GPU 0 ("Duplicate GPU detected" under NCCL).
    seen: list[object] = []

    class FakeStream:
        def __init__(self, device: torch.device) -> None:
            seen.append(("stream", device))

        def wait_event(self, event: object) -> None:
            seen.append(("wait", event))

    class FakeStreamContext:
        def __init__(self, stream: FakeStream) -> None:
            seen.append("on stream")

        def __enter__(self) -> None:
            return None

        def __exit__(self, *exc: object) -> None:
            seen.append("off stream")

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: seen.append(("set_device", device)))
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", FakeStreamContext)
    device = torch.device("cuda", 3)
    with exchange_context(device, "ready-event", ExchangeStreams()):
        seen.append("work")
    assert seen == [("set_device", device), ("stream", device), ("wait", "ready-event"), "on stream", "work", "off stream"]
    seen.clear()
    with exchange_context(torch.device("cpu"), None, ExchangeStreams()):
        seen.append("work")
    assert seen == ["work"]


def test_host_marks_give_spans_at_once() -> None:
    start = clock.now(torch.device("cpu"))
    end = clock.now(torch.device("cpu"))
    assert clock.readable_now(start)
    assert clock.seconds(start, end) == end - start >= 0.0


def test_checkpoint_gathers_stay_off_nccl() -> None:
    # gather_object over NCCL stages every rank's residuals on rank 0's GPU.
    assert has_cpu_backend("gloo") and has_cpu_backend("cpu:gloo,cuda:nccl")
    assert not has_cpu_backend("nccl")
