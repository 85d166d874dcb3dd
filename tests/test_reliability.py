"""Faults and composition: mismatched ranks, stalled ranks, hostile numbers, AMP, no_sync, compile."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from flexcomm.compress import ResidualMemory, k_for, mstopk_indices, topk_indices
from multiproc import raised, run_world
from test_hook_distributed import DENSITY, GradientInjector, exchange, gradient, hooked_model, topk_sparse

# ---------------------------------------------------------------- mismatched configuration

def _mismatched(rank: int, world: int) -> str:
    model, _ = hooked_model(compressor="artopk-star", density=0.01 if rank == 0 else 0.02)
    return raised(lambda: exchange(model, gradient(rank, 0)))


def test_configuration_mismatch_fails_on_every_rank_naming_the_difference() -> None:
    for message in run_world(_mismatched, 2):
        assert "configuration differs across ranks" in message
        assert "density: rank 0=0.01, rank 1=0.02" in message


# ---------------------------------------------------------------- a stalled rank

def _stall(rank: int, world: int, stall_s: float) -> str:
    model, _ = hooked_model(compressor="artopk-star", density=DENSITY)
    exchange(model, gradient(rank, 0))
    if rank == 1:
        time.sleep(stall_s)
    try:
        exchange(model, gradient(rank, 1))
    except Exception as err:
        return f"{type(err).__name__}: {err}"
    return "no error"


def test_a_stalled_rank_makes_the_others_fail_within_the_timeout() -> None:
    # Process-group timeout 3 s, rank 1 stalls 12 s: rank 0 must give up with a timeout error
    # instead of waiting (rank 1 then finds its peer gone).
    results = run_world(_stall, 2, 12.0, timeout_s=3.0, sync_exit=False)
    assert "no error" not in results[0]
    assert "timed out" in results[0].lower() or "timeout" in results[0].lower()


# ---------------------------------------------------------------- restart from a checkpoint

def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))


def _train_steps(model: DDP, opt: torch.optim.Optimizer, rank: int, steps: range) -> None:
    for step in steps:
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()


# flex decides from measured times, which differ between the two runs; it takes no new
# decision in steps 5-7 (it agrees on measurements at steps 1, 2, 4, 8 and every
# flex_interval; explores at multiples of 10; guard trials at steps 0-2 mod 25; checks an
# all-dense step 4 at step 5 on step 4's samples, which the checkpoint holds), so from a
# checkpoint after step 5 a correct restore reproduces steps 5-7 bit for bit.
RESUME_AT, END = 5, 8


def _resume(rank: int, world: int, compressor: str) -> dict:
    def fresh() -> tuple[DDP, torch.optim.Optimizer, flexcomm.FlexState]:
        # One bucket whose parameter order DDP reverses after step 0: a restarted DDP starts
        # again from the initial order, so the residuals must follow their parameters.
        model = DDP(_mlp())
        state = flexcomm.register(model, compressor=compressor, density=0.05)
        return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9), state

    model, opt, state = fresh()
    _train_steps(model, opt, rank, range(RESUME_AT))
    checkpoint = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                  "opt": copy.deepcopy(opt.state_dict()), "flex": copy.deepcopy(state.state_dict())}
    _train_steps(model, opt, rank, range(RESUME_AT, END))
    uninterrupted = [p.detach().clone() for p in model.parameters()]

    model, opt, state = fresh()  # a restarted process: new DDP, initial bucket layout
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["opt"])
    state.load_state_dict(checkpoint["flex"])
    _train_steps(model, opt, rank, range(RESUME_AT, END))
    resumed = [p.detach().clone() for p in model.parameters()]
    return {"equal": all(torch.equal(a, b) for a, b in zip(uninterrupted, resumed)), "step": state.step}


@pytest.mark.parametrize("compressor", ["artopk-var", "flex"])
def test_resume_from_checkpoint_continues_bitwise(compressor: str) -> None:
    for result in run_world(_resume, 2, compressor):
        assert result == {"equal": True, "step": END}


# ---------------------------------------------------------------- hostile numbers

def _hostile(rank: int, world: int) -> dict:
    out = {}
    cases = {
        "zeros": torch.zeros(5000),
        "ties": torch.ones(5000) * (1 + rank),
        "denormal": torch.full((5000,), 1e-40) * torch.arange(1, 5001),
        "one_element": torch.tensor([3.0 + rank]),
        "inf": gradient(rank, 0) if rank == 0 else torch.full((5000,), float("inf")),
    }
    for name, g in cases.items():
        for compressor in ("agtopk", "mstopk", "artopk-star", "artopk-var"):
            model, state = hooked_model(numel=g.numel(), compressor=compressor, density=1e-9)
            update = exchange(model, g)
            residual = state.memory.residual(0)
            out[(name, compressor)] = (update, residual, state.drain_records()[-1].k)
    return out


def test_hostile_gradients() -> None:
    results = run_world(_hostile, 2)
    for rank, result in enumerate(results):
        for compressor in ("agtopk", "mstopk", "artopk-star", "artopk-var"):
            update, residual, k = result[("zeros", compressor)]
            assert k == 1  # density so small that k = 0 is clamped to 1
            assert not update.any() and not residual.any()
            update, _, _ = result[("ties", compressor)]
            assert torch.isfinite(update).all() and int((update != 0).sum()) >= 1
            update, residual, _ = result[("denormal", compressor)]
            assert torch.isfinite(update).all() and update.abs().max() > 0
            update, residual, _ = result[("one_element", compressor)]
            torch.testing.assert_close(update, torch.tensor([3.5]))  # k = 1 = everything: the plain average
            update, residual, _ = result[("inf", compressor)]
            assert not torch.isfinite(update).all()  # the Inf reaches every rank...
            assert residual is None  # ...and no residual was written from it


# ---------------------------------------------------------------- composing with how people train

def _grad_scaler(rank: int, world: int) -> dict:
    model, state = hooked_model(compressor="artopk-star", density=DENSITY)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    history = []
    for step in range(3):
        g = gradient(rank, step)
        if step == 1 and rank == 1:
            g[0] = float("inf")
        opt.zero_grad()
        scaler.scale(model(g)).backward()
        before = model.module.weight.detach().clone()
        scaler.step(opt)
        scaler.update()
        history.append({"moved": not torch.equal(before, model.module.weight), "scale": scaler.get_scale()})
    return {"history": history, "residual_finite": bool(torch.isfinite(state.memory.residual(0)).all())}


def test_grad_scaler_skips_a_non_finite_step_on_every_rank() -> None:
    results = run_world(_grad_scaler, 2)
    for result in results:
        moved = [h["moved"] for h in result["history"]]
        assert moved == [True, False, True]
        scales = [h["scale"] for h in result["history"]]
        assert scales[1] == scales[0] / 2  # found_inf on every rank
        assert result["residual_finite"]
    assert results[0]["history"] == results[1]["history"]


def _no_sync(rank: int, world: int) -> torch.Tensor:
    model, _ = hooked_model(compressor="artopk-star", density=DENSITY)
    model.zero_grad(set_to_none=True)
    with model.no_sync():
        model(gradient(rank, 0)).backward()
    model(gradient(rank, 1)).backward()
    return model.module.weight.grad.detach().clone()


def test_gradient_accumulation_with_no_sync() -> None:
    results = run_world(_no_sync, 2)
    summed = [gradient(r, 0) + gradient(r, 1) for r in range(2)]
    k = k_for(summed[0].numel(), DENSITY)
    indices = torch.topk(summed[0].abs(), k).indices
    expected = torch.zeros_like(summed[0])
    expected[indices] = torch.stack(summed).mean(0)[indices]
    for update in results:
        torch.testing.assert_close(update, expected)


def _fp16_wrapper(rank: int, world: int) -> torch.Tensor:
    model = DDP(GradientInjector(5000))
    model.register_comm_hook(flexcomm.FlexState(compressor="agtopk", density=DENSITY), default_hooks.fp16_compress_wrapper(flexcomm.hook))
    return exchange(model, gradient(rank, 0))


def test_pytorch_fp16_compress_wrapper_around_the_hook() -> None:
    results = run_world(_fp16_wrapper, 2)
    k = k_for(5000, DENSITY)
    expected = torch.stack([topk_sparse(gradient(r, 0).half().float(), k) for r in range(2)]).mean(0)
    for update in results:
        assert update.dtype == torch.float32
        torch.testing.assert_close(update, expected, atol=2e-3, rtol=2e-3)


def _compiled(rank: int, world: int) -> dict:
    out = {}
    for compiled in (False, True):
        torch.manual_seed(0)
        net = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))
        model = DDP(net)
        model.register_comm_hook(flexcomm.FlexState(compressor="artopk-star", density=0.1), flexcomm.hook)
        # aot_eager: graph capture through dynamo and AOTAutograd without a C++ toolchain.
        runner = torch.compile(model, backend="aot_eager") if compiled else model
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(rank))
        grads = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            runner(x).square().sum().backward()
            grads.append([p.grad.clone() for p in net.parameters()])
        out[compiled] = grads
    return out


def test_torch_compile_with_the_hook_matches_eager() -> None:
    for result in run_world(_compiled, 2):
        for eager, compiled in zip(result[False], result[True]):
            for a, b in zip(eager, compiled):
                torch.testing.assert_close(a, b)


# ---------------------------------------------------------------- property-based: error feedback

DTYPES = st.sampled_from([torch.float32, torch.float16, torch.bfloat16, torch.float64])


@settings(max_examples=60, deadline=None)
@given(
    world=st.integers(1, 6),
    numel=st.integers(1, 3000),
    density=st.floats(1e-4, 1.0),
    dtype=DTYPES,
    steps=st.integers(1, 3),
    selector=st.sampled_from(["topk", "mstopk", "leader"]),
    seed=st.integers(0, 2**16),
)
def test_error_feedback_invariant_holds_for_any_shape_dtype_density_world(world, numel, density, dtype, steps, selector, seed) -> None:
    """Simulated ranks: sent + new residual == accumulated gradient, exactly, at every step."""
    gen = torch.Generator().manual_seed(seed)
    memories = [ResidualMemory() for _ in range(world)]
    layout = ((numel,),)
    k = k_for(numel, density)
    for step in range(steps):
        accumulated = [m.compensate(0, layout, torch.randn(numel, generator=gen).to(dtype)) for m in memories]
        leader_indices = topk_indices(accumulated[step % world], k)
        for a, memory in zip(accumulated, memories):
            if selector == "topk":
                indices = topk_indices(a, k)
            elif selector == "mstopk":
                indices = mstopk_indices(a, k, rounds=8)
            else:
                indices = leader_indices
            assert indices.numel() <= k and len(set(indices.tolist())) == indices.numel()
            snapshot = a.clone()
            memory.update(0, layout, a, indices)
            sent = torch.zeros_like(a)
            sent[indices.long()] = snapshot[indices.long()]
            assert torch.equal(sent + memory.residual(0), snapshot)
            if selector == "topk":
                # Exact top-k: nothing left behind is larger than anything sent.
                left = memory.residual(0).abs()
                assert k == numel or float(left.max()) <= float(snapshot.abs()[indices.long()].min())


# ---------------------------------------------------------------- per-rank state can't be mixed up

def _load_another_ranks_state(rank: int, world: int) -> str:
    model, state = hooked_model(compressor="artopk-star", density=DENSITY)
    exchange(model, gradient(rank, 0))
    saved: list = [None] * world
    torch.distributed.all_gather_object(saved, state.state_dict())
    state.load_state_dict(saved[rank])  # its own state loads
    try:
        state.load_state_dict(saved[(rank + 1) % world])
    except ValueError as err:
        return str(err)
    return "no error"


def test_loading_another_ranks_state_fails_naming_both_ranks() -> None:
    for rank, message in enumerate(run_world(_load_another_ranks_state, 2)):
        assert f"belongs to rank {(rank + 1) % 2} of 2" in message
        assert f"loaded on rank {rank}" in message


def test_register_on_a_model_not_wrapped_in_ddp_says_where_to_call_it() -> None:
    with pytest.raises(TypeError) as raised:
        flexcomm.register(nn.Linear(4, 2), compressor="artopk-star", density=0.1)
    message = str(raised.value)
    assert "needs a torch.nn.parallel.DistributedDataParallel model, got Linear" in message
    assert "Lightning: use flexcomm.lightning.FlexCommStrategy" in message
    assert "Accelerate: call flexcomm.accelerate.register(accelerator, model, ...) after accelerator.prepare" in message
