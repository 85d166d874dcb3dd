"""Ordered dispatch: many buckets, random per-rank delays, no mismatch, no hang; the fused local work.

Every bucket is one parameter (DDP's bucket cap below one parameter's size), so the
reference can follow each bucket's error feedback on its own, in plain torch.  DDP's
first backward runs with all parameters in one bucket and then rebuilds; one step of
zero gradients first (it sends zeros and leaves zero residuals) puts the real steps on
the final buckets, at step counter 1 onwards.
"""

from __future__ import annotations

import random
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from flexcomm.comm import Dispatcher
from flexcomm.compress import k_for, unpack_all
from multiproc import run_world

BUCKETS = 10
NUMEL = 4096
DENSITY = 0.02


class _SlowBackward(torch.autograd.Function):
    """Identity whose backward sleeps: buckets reach the hook at rank-dependent times."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, delay: float) -> torch.Tensor:
        ctx.delay = delay
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        time.sleep(ctx.delay)
        return grad, None


class ManyBuckets(nn.Module):
    """BUCKETS parameters; the loss ``sum_j sum(p_j * g_j)`` makes ``p_j.grad == g_j``."""

    def __init__(self, rng: random.Random) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.zeros(NUMEL)) for _ in range(BUCKETS)])
        self.rng = rng

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((_SlowBackward.apply(w, self.rng.uniform(0, 0.004)) * g).sum() for w, g in zip(self.weights, grads))


def gradients(rank: int, step: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(10_000 * step + 100 * rank + 7)
    return [torch.randn(NUMEL, generator=gen) * (1 + j) for j in range(BUCKETS)]


def _delay_collectives(rng: random.Random) -> None:
    """Every collective this process issues waits a random 0-4 ms first."""
    for name in ("all_reduce", "broadcast", "all_gather_into_tensor"):
        original = getattr(dist, name)

        def delayed(*args, _original=original, **kwargs):
            time.sleep(rng.uniform(0, 0.004))
            return _original(*args, **kwargs)

        setattr(dist, name, delayed)


def one_bucket_per_parameter(rng: random.Random, compressor: str) -> tuple[DDP, flexcomm.FlexState]:
    model = DDP(ManyBuckets(rng), bucket_cap_mb=NUMEL * 4 / 2**20 / 2)
    state = flexcomm.register(model, compressor=compressor, density=DENSITY)
    model(gradients(0, 0)).mul(0).backward()  # DDP's first backward, then its bucket rebuild
    state.drain_records()
    return model, state


def _train_with_delays(rank: int, world: int, compressor: str, steps: int) -> dict:
    rng = random.Random(1234 + rank)
    _delay_collectives(rng)
    model, state = one_bucket_per_parameter(rng, compressor)
    updates = []
    for step in range(steps):
        model.zero_grad(set_to_none=True)
        model(gradients(rank, step)).backward()
        updates.append([w.grad.detach().clone() for w in model.module.weights])
    records = state.drain_records()
    return {"updates": updates, "buckets_per_step": len(records) / steps, "leaders": sorted({r.leader for r in records})}


def reference(world: int, compressor: str, steps: int) -> list[list[torch.Tensor]]:
    """AR-Topk (STAR) or AG-Topk with error feedback, per parameter, all ranks simulated."""
    k = k_for(NUMEL, DENSITY)
    residuals = [[torch.zeros(NUMEL) for _ in range(BUCKETS)] for _ in range(world)]
    out = []
    for step in range(steps):
        grads = [gradients(r, step) for r in range(world)]
        step_updates = []
        for j in range(BUCKETS):
            accumulated = [grads[r][j] + residuals[r][j] for r in range(world)]
            if compressor == "artopk-star":
                leader_indices = torch.topk(accumulated[(step + 1) % world].abs(), k).indices  # after the zero step
                chosen = [leader_indices] * world
            else:
                chosen = [torch.topk(a.abs(), k).indices for a in accumulated]
            update = torch.zeros(NUMEL)
            for r, (a, idx) in enumerate(zip(accumulated, chosen)):
                update.index_add_(0, idx, a[idx])
                residuals[r][j] = a.clone().index_fill_(0, idx, 0)
            step_updates.append(update / world)
        out.append(step_updates)
    return out


@pytest.mark.parametrize("compressor,world", [("artopk-star", 2), ("artopk-star", 4), ("agtopk", 2)])
def test_many_buckets_with_random_delays_match_the_reference_on_every_rank(compressor: str, world: int) -> None:
    steps = 4
    results = run_world(_train_with_delays, world, compressor, steps, timeout_s=60.0)
    expected = reference(world, compressor, steps)
    for rank, result in enumerate(results):
        assert result["buckets_per_step"] == BUCKETS  # really one bucket per parameter
        for step in range(steps):
            for j in range(BUCKETS):
                torch.testing.assert_close(result["updates"][step][j], expected[step][j], msg=f"rank {rank} step {step} bucket {j}")
                # Every rank holds the same update, bit for bit (the same collectives, in the same order).
                assert torch.equal(result["updates"][step][j], results[0]["updates"][step][j])
    if compressor == "artopk-star":
        assert results[0]["leaders"] == list(range(world))


# ---------------------------------------------------------------- the fused local work, bit for bit

def _capture_what_is_sent() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Copies of what this process hands to allreduce/allgather (before they run) and of the broadcast indices (after)."""
    messages: list[torch.Tensor] = []
    indices: list[torch.Tensor] = []
    gather_name = "all_gather_single" if hasattr(dist, "all_gather_single") else "all_gather_into_tensor"
    reduce, gather, broadcast = dist.all_reduce, getattr(dist, gather_name), dist.broadcast

    def all_reduce(tensor, *args, **kwargs):
        messages.append(tensor.detach().clone())
        return reduce(tensor, *args, **kwargs)

    def all_gather_into_tensor(output, message, *args, **kwargs):
        messages.append(message.detach().clone())
        return gather(output, message, *args, **kwargs)

    def broadcast_indices(tensor, *args, **kwargs):
        work = broadcast(tensor, *args, **kwargs)  # blocking: the tensor holds the leader's indices now
        indices.append(tensor.detach().clone())
        return work

    dist.all_reduce, dist.broadcast = all_reduce, broadcast_indices
    setattr(dist, gather_name, all_gather_into_tensor)
    return messages, indices


def _sent_and_residuals(rank: int, world: int, compressor: str, steps: int) -> list[str]:
    """Per bucket and step: what this rank sent (times N: ranks send ``a_i[I] / N``) plus its new residual
    equals its a_i, bit for bit (N = 2: the division is exact)."""
    messages, broadcast_indices = _capture_what_is_sent()
    model, state = one_bucket_per_parameter(random.Random(rank), compressor)
    names = {f"weights.{j}": j for j in range(BUCKETS)}
    k = k_for(NUMEL, DENSITY)
    failures = []
    for step in range(steps):
        grads = gradients(rank, step)
        before = state.memory.state_dict()["pieces"]  # residual per parameter name
        messages.clear()
        broadcast_indices.clear()
        model.zero_grad(set_to_none=True)
        model(grads).backward()
        after = state.memory.state_dict()["pieces"]
        for position, rec in enumerate(state.drain_records()):
            ((name, _),) = state.memory.layout(rec.bucket)
            g = grads[names[name]]
            a = g if name not in before else torch.add(g, before[name])
            if compressor == "agtopk":
                values, indices = unpack_all(messages[position], 1, k, torch.float32)
            else:
                values, indices = messages[position][:k], broadcast_indices[position]
            sent = torch.zeros(NUMEL).index_put_((indices.long(),), values * world)
            if not torch.equal(sent + after[name], a):
                failures.append(f"step {step} {name}: sent + new residual != a_i")
            if int((sent != 0).sum()) > k:
                failures.append(f"step {step} {name}: more than k values sent")
    return failures


@pytest.mark.parametrize("compressor", ["artopk-star", "agtopk"])
def test_sent_plus_new_residual_equals_the_accumulated_gradient_bit_for_bit(compressor: str) -> None:
    for failures in run_world(_sent_and_residuals, 2, compressor, 3):
        assert failures == []


# ---------------------------------------------------------------- the dispatcher itself

def test_dispatcher_runs_in_order_and_propagates_errors() -> None:
    dispatcher = Dispatcher()
    order: list[int] = []

    def task(i: int, fail: bool = False):
        def run() -> torch.futures.Future:
            order.append(i)
            if fail:
                raise RuntimeError(f"collective {i} failed")
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result(torch.tensor([i]))
            return fut
        return run

    futures = [dispatcher.submit(task(i)) for i in range(5)]
    assert [int(f.wait()) for f in futures] == list(range(5))
    failed = dispatcher.submit(task(5, fail=True))
    with pytest.raises(RuntimeError, match="collective 5 failed"):
        failed.wait()
    later = dispatcher.submit(task(6))
    with pytest.raises(RuntimeError, match="an earlier exchange failed, so this one was not started"):
        later.wait()
    assert order == list(range(6))  # the task after the failure never ran


def test_dispatcher_propagates_an_asynchronous_error() -> None:
    dispatcher = Dispatcher()
    pending: torch.futures.Future = torch.futures.Future()
    result = dispatcher.submit(lambda: pending)
    pending.set_exception(RuntimeError("timed out waiting for peer"))
    with pytest.raises(RuntimeError, match="timed out waiting for peer"):
        result.wait()
