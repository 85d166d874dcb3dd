"""The low-rank exchange (PowerSGD's subspace iteration with per-rank error feedback) on real gloo groups.

Gradients are injected exactly (the loss is ``sum_j sum(p_j * g_j)``), and a plain-torch
reference simulates every rank: ``P = orth(sum_i M_i Q)``, ``Q_i = M_i^T P``, update
``P (sum_i Q_i)^T / N``, residual ``M_i - P Q_i^T``, warm start ``Q <- sum_i Q_i``.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from flexcomm.compress.lowrank import LowRankQueries, Split, compressible, orthonormalize_
from delays import SlowBackward
from multiproc import raised, run_world

RANK = 4
SHAPES = [(48, 40), (48,), (8, 3, 3, 3), (3, 5)]  # a matrix, a bias, a conv kernel, a matrix too small to factor


class Injector(nn.Module):
    """Parameters of ``shapes``; ``p_j.grad == g_j`` after backward of ``forward(g)``."""

    def __init__(self, shapes: list[tuple[int, ...]]) -> None:
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(torch.zeros(s)) for s in shapes])

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((p * g).sum() for p, g in zip(self.params, grads))


def gradients(rank: int, step: int, shapes: list[tuple[int, ...]] = SHAPES) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + 3)
    return [torch.randn(s, generator=gen) for s in shapes]


def _train(rank: int, world: int, steps: int, nan_at: tuple[int, int] | None = None) -> dict:
    model = DDP(Injector(SHAPES))
    state = flexcomm.register(model, compressor="lowrank", rank=RANK)
    updates, residuals = [], []
    for step in range(steps):
        grads = gradients(rank, step)
        if nan_at == (rank, step):
            grads[0][0, 0] = float("nan")
        model.zero_grad(set_to_none=True)
        model(grads).backward()
        updates.append([p.grad.detach().clone() for p in model.module.params])
        residual = state.memory.residual(0)
        residuals.append(None if residual is None else residual.clone())
    records = state.drain_records()
    return {"updates": updates, "residuals": residuals, "records": records, "state": state.state_dict(),
            "order": [tuple(p.shape) for p in model.module.params]}


def first_queries() -> list[torch.Tensor]:
    """The queries every rank starts from (keyed by the parameters' names), in model order."""
    layout = [(f"params.{j}", 0) for j in range(len(SHAPES))]
    return LowRankQueries(RANK).bucket(0, layout, SHAPES, torch.device("cpu"), named=True).queries


def reference(world: int, steps: int) -> list[list[torch.Tensor]]:
    """Every rank simulated in plain torch; updates per step in the model's parameter order."""
    matrix_ids = [j for j, s in enumerate(SHAPES) if compressible(s, RANK)]
    q = {j: query.clone() for j, query in zip(matrix_ids, first_queries())}
    residual = [[torch.zeros(s) for s in SHAPES] for _ in range(world)]
    out = []
    for step in range(steps):
        a = [[g + e for g, e in zip(gradients(r, step), residual[r])] for r in range(world)]
        update = [torch.stack([a[r][j] for r in range(world)]).mean(0) for j in range(len(SHAPES))]
        for r in range(world):
            for j in range(len(SHAPES)):
                if j not in matrix_ids:
                    residual[r][j] = torch.zeros(SHAPES[j])
        for j in matrix_ids:
            ms = [a[r][j].reshape(SHAPES[j][0], -1) for r in range(world)]
            p, _ = torch.linalg.qr(sum(m @ q[j] for m in ms))
            own = [m.t() @ p for m in ms]
            total = sum(own)
            update[j] = (p @ total.t() / world).reshape(SHAPES[j])
            for r in range(world):
                residual[r][j] = (ms[r] - p @ own[r].t()).reshape(SHAPES[j])
            q[j] = total
        out.append(update)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_updates_match_the_reference_and_every_rank_agrees(world: int) -> None:
    steps = 4
    results = run_world(_train, world, steps)
    assert results[0]["order"] == SHAPES
    expected = reference(world, steps)
    for step in range(steps):
        for j in range(len(SHAPES)):
            got = results[0]["updates"][step][j]
            torch.testing.assert_close(got, expected[step][j], rtol=1e-4, atol=1e-5)
            for r in range(1, world):
                assert torch.equal(results[r]["updates"][step][j], got), (step, j, r)


def _conservation(rank: int, world: int, steps: int) -> dict:
    out = _train(rank, world, steps)
    return {"updates": out["updates"], "residual": out["residuals"][-1], "records": out["records"]}


@pytest.mark.parametrize("world", [2, 4])
def test_error_feedback_nothing_lost_or_counted_twice(world: int) -> None:
    """sum over steps of N * update + sum over ranks of the last residual == sum of every gradient."""
    steps = 5
    results = run_world(_conservation, world, steps)
    sent = sum(torch.cat([u.reshape(-1) for u in step]) for step in results[0]["updates"]) * world
    kept = sum(r["residual"] for r in results)
    # The residual buffer holds the bucket in DDP's order: reverse the per-parameter pieces.
    pieces, offset = {}, 0
    for j in reversed(range(len(SHAPES))):
        n = torch.Size(SHAPES[j]).numel()
        pieces[j] = kept[offset : offset + n]
        offset += n
    kept_model_order = torch.cat([pieces[j] for j in range(len(SHAPES))])
    total = sum(torch.cat([g.reshape(-1) for g in gradients(r, s)]) for r in range(world) for s in range(steps))
    torch.testing.assert_close(sent + kept_model_order, total, rtol=1e-4, atol=1e-4)
    rec = results[0]["records"][-1]
    assert rec.exchange == "lowrank"
    matrices = (48 + 40) * RANK + (8 + 27) * RANK
    assert rec.k == matrices + 48 + 15 and rec.bytes_sent == 4 * rec.k
    assert 0.0 < rec.gain < 1.0


def test_nan_on_one_rank_reaches_every_rank_and_the_next_step_is_clean() -> None:
    results = run_world(_train, 2, 3, (1, 1))
    for r in range(2):
        assert all(torch.isnan(u).all() for u in results[r]["updates"][1])
        assert results[r]["residuals"][1] is None  # dropped on every rank
        assert all(torch.isfinite(u).all() for u in results[r]["updates"][2])  # the queries kept their finite values
        assert results[r]["records"][1].finite is False


def test_split_views_and_payload() -> None:
    split = Split.of(SHAPES, RANK)
    assert split.matrices == ((0, 48, 40), (48 * 40 + 48, 8, 27)) and split.rest == ((48 * 40, 48), (48 * 40 + 48 + 216, 15))
    flat = torch.arange(float(sum(torch.Size(s).numel() for s in SHAPES)))
    matrices, rest = split.views(flat)
    assert matrices[1].shape == (8, 27) and matrices[1][0, 0] == 48 * 40 + 48
    matrices[0][0, 0] = -1.0
    assert flat[0] == -1.0  # views, not copies
    assert [r.numel() for r in rest] == [48, 15]
    assert sum(split.payload()) == (48 + 8) * RANK + 63 + (40 + 27) * RANK
    assert split.payload(1024) == ((48 + 8) * RANK + 63, (40 + 27) * RANK + 1024)
    packed = torch.zeros(split.q_numel)
    assert [v.shape for v in split.factor_views(packed, "q")] == [(RANK, 40), (RANK, 27)]  # Q travels transposed


def test_compressible_only_where_factors_are_smaller() -> None:
    assert compressible((48, 40), 4) and compressible((8, 3, 3, 3), 4)
    assert not compressible((48,), 4) and not compressible((3, 5), 4) and not compressible((8, 8), 4)  # 64 = 64


def test_orthonormalize_gives_orthonormal_columns_spanning_the_same_space() -> None:
    p = torch.randn(30, 4, generator=torch.Generator().manual_seed(0))
    original = p.clone()
    orthonormalize_(p)
    torch.testing.assert_close(p.t() @ p, torch.eye(4), atol=1e-5, rtol=0)
    torch.testing.assert_close(p @ (p.t() @ original), original, atol=1e-5, rtol=1e-5)


def test_queries_start_alike_follow_their_parameter_and_round_trip() -> None:
    cpu = torch.device("cpu")
    layout = [("w", 0), ("b", 0), ("conv", 0), ("small", 0)]
    a, b = LowRankQueries(RANK), LowRankQueries(RANK)
    qa = a.bucket(0, layout, SHAPES, cpu, named=True).queries
    assert [q.shape for q in qa] == [(40, RANK), (27, RANK)]
    assert all(torch.equal(x, y) for x, y in zip(qa, b.bucket(0, layout, SHAPES, cpu, named=True).queries))
    qa[0].fill_(3.0)  # as an exchange updates it
    # A rebuilt bucket (another index, another order) finds the named parameter's query.
    moved = a.bucket(5, [("conv", 0), ("w", 0)], [SHAPES[2], SHAPES[0]], cpu, named=True).queries
    assert moved[1] is qa[0]
    # Anonymous layouts key by bucket and position: another bucket index starts afresh.
    anonymous = a.bucket(1, layout, SHAPES, cpu, named=False).queries
    assert not torch.equal(anonymous[0], qa[0])
    c = LowRankQueries(RANK)
    c.load_state_dict(a.state_dict())
    assert torch.equal(c.bucket(0, layout, SHAPES, cpu, named=True).queries[0], qa[0])


def test_bad_rank_and_auto_density_are_refused_with_a_reason() -> None:
    assert "rank must be >= 1, got 0" in raised(lambda: flexcomm.FlexState(compressor="lowrank", rank=0))
    assert "rank must be an int" in raised(lambda: LowRankQueries(2.5))  # type: ignore[arg-type]
    assert "compressor='lowrank' sends rank-r factors" in raised(lambda: flexcomm.FlexState(compressor="lowrank", density="auto"))
    state = LowRankQueries(2)
    assert "rank 2, this run has rank 4" in raised(lambda: LowRankQueries(4).load_state_dict(state.state_dict()))


def _many_buckets(rank: int, world: int, steps: int) -> dict:
    rng = random.Random(99 + rank)
    original = dist.all_reduce

    def delayed(*args, **kwargs):
        time.sleep(rng.uniform(0, 0.004))
        return original(*args, **kwargs)

    dist.all_reduce = delayed
    shapes = [(64, 32)] * 8
    model = Injector(shapes)
    forward = model.forward
    model.forward = lambda grads: forward([SlowBackward.apply(g, rng.uniform(0, 0.003)) for g in grads])  # type: ignore[method-assign]
    ddp = DDP(model, bucket_cap_mb=64 * 32 * 4 / 2**20 / 2)  # one parameter per bucket after the rebuild
    state = flexcomm.register(ddp, compressor="lowrank", rank=2)
    updates = []
    for step in range(steps):
        ddp.zero_grad(set_to_none=True)
        ddp(gradients(rank, step, shapes)).backward()
        updates.append(torch.cat([p.grad.reshape(-1) for p in model.params]))
    return {"updates": updates, "buckets": {r.bucket for r in state.drain_records()}}


def test_many_buckets_with_random_delays_agree_on_every_rank() -> None:
    results = run_world(_many_buckets, 4, 6)
    assert len(results[0]["buckets"]) == 8
    for step in range(6):
        assert torch.isfinite(results[0]["updates"][step]).all()
        for r in range(1, 4):
            assert torch.equal(results[r]["updates"][step], results[0]["updates"][step])


ORDER_SHAPES = [(40, 24), (36, 20), (28, 16)]  # every factor of another size: a collective's size names it


def _three_buckets(rank: int, steps: int) -> tuple[DDP, flexcomm.FlexState]:
    """A low-rank rank-2 DDP model of :data:`ORDER_SHAPES`, one parameter per bucket, after ``steps`` steps."""
    ddp = DDP(Injector(ORDER_SHAPES), bucket_cap_mb=28 * 16 * 4 / 2**20)  # one parameter per bucket after the rebuild
    state = flexcomm.register(ddp, compressor="lowrank", rank=2)
    for step in range(steps):
        ddp.zero_grad(set_to_none=True)
        ddp(gradients(rank, step, ORDER_SHAPES)).backward()
    return ddp, state


def _issue_order(rank: int, world: int, steps: int) -> list[int]:
    sizes = []
    original = dist.all_reduce

    def logged(tensor, *args, **kwargs):
        sizes.append(tensor.numel())
        return original(tensor, *args, **kwargs)

    dist.all_reduce = logged
    _three_buckets(rank, steps)
    return sizes


def test_a_bucket_s_second_allreduce_waits_for_the_next_bucket_s_first() -> None:
    # The P allreduce's round trip overlaps the next bucket: bucket b's Q allreduce goes out
    # right after bucket b + 1's P allreduce, the last bucket's right after its own.  Buckets
    # arrive in reverse parameter order; P is n x 2, Q is m x 2.
    p_size = {i: n * 2 for i, (n, _) in enumerate(ORDER_SHAPES)}
    q_size = {i: m * 2 for i, (_, m) in enumerate(ORDER_SHAPES)}
    b0, b1, b2 = 2, 1, 0
    expected = [p_size[b0], p_size[b1], q_size[b0], p_size[b2], q_size[b1], q_size[b2]]
    for sizes in run_world(_issue_order, 2, 3):
        factors = [s for s in sizes if s in set(expected)]
        assert factors[-6:] == expected


def _later_bucket_fails(rank: int, world: int) -> str:
    ddp, state = _three_buckets(rank, 2)  # DDP rebuilds its buckets after the first step
    prepare = state.prepare

    def failing_at_the_last_bucket(handed):
        if handed.closes_step:
            raise RuntimeError("the last bucket's exchange failed")
        return prepare(handed)

    state.prepare = failing_at_the_last_bucket  # type: ignore[method-assign]
    ddp.zero_grad(set_to_none=True)
    outcome = ["backward still waiting after 20 s"]

    def train_step() -> None:
        outcome[0] = raised(lambda: ddp(gradients(rank, 2, ORDER_SHAPES)).backward())

    step = threading.Thread(target=train_step, daemon=True)  # a stranded bucket would block it for good
    step.start()
    step.join(20)
    return outcome[0]


def test_a_failed_bucket_fails_the_step_instead_of_stranding_an_earlier_bucket_s_half() -> None:
    # Buckets 0 and 1 deferred their second halves; bucket 2 fails before running them.  Their
    # futures must fail too: DDP waits for every bucket, and would wait forever.
    for message in run_world(_later_bucket_fails, 2, timeout_s=30, sync_exit=False):
        assert "exchange failed" in message


def _dtypes(rank: int, world: int) -> dict:
    out = {}
    for dtype in (torch.float64, torch.bfloat16):
        model = DDP(Injector([(48, 40)]).to(dtype))
        state = flexcomm.register(model, compressor="lowrank", rank=RANK)
        grads = [g.to(dtype) for g in gradients(rank, 0, [(48, 40)])]
        model(grads).backward()
        out[str(dtype)] = (model.module.params[0].grad.detach().clone(), state.memory.residual(0).dtype)
    return out


def test_fp64_gradients_are_factored_in_fp64_and_half_ones_update_in_their_dtype() -> None:
    results = run_world(_dtypes, 2)
    for r in results:
        update, residual = r["torch.float64"]
        assert update.dtype == torch.float64 and residual == torch.float64
        update, residual = r["torch.bfloat16"]
        assert update.dtype == torch.bfloat16 and residual == torch.float32  # residuals stay fp32
        assert torch.isfinite(update.float()).all()
    assert torch.equal(results[0]["torch.float64"][0], results[1]["torch.float64"][0])
