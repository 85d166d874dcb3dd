"""The accumulation pass (flexcomm.compress.fused) and the in-place residual it serves."""

from __future__ import annotations

import pytest
import torch

from flexcomm.compress import ResidualMemory, TopkWorkspace, k_for
from flexcomm.compress.fused import accumulate_in_place

LAYOUT = (("w", 300_000),)


def heavy(numel: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(numel, generator=gen) * torch.randn(numel, generator=gen).exp()).to(dtype)


def top_set(x: torch.Tensor, k: int) -> set[int]:
    return set(torch.topk(x.abs().float(), k).indices.tolist())


@pytest.mark.parametrize("numel,density,dtype", [
    (300_000, 0.01, torch.float32),   # the blocked pass with its candidate selection (3 blocks)
    (300_000, 0.01, torch.float64),
    (1_000, 0.01, torch.float32),     # below the candidate pass's size: blocked add, full selection
    (300_000, 0.5, torch.float32),    # k too large a share for candidates
])
def test_the_pass_adds_in_place_zeroes_the_bucket_and_selects_the_exact_top_k(numel: int, density: float,
                                                                                dtype: torch.dtype) -> None:
    g, e = heavy(numel, 0, dtype), heavy(numel, 1, dtype)
    grad, residual = g.clone(), e.clone()
    k = k_for(numel, density)
    out = accumulate_in_place(residual, grad, k, TopkWorkspace())
    assert out.a.data_ptr() == residual.data_ptr()
    assert torch.equal(residual, g + e)
    assert not grad.any()
    torch.testing.assert_close(out.norm, torch.linalg.vector_norm(g + e), rtol=1e-5, atol=0)
    assert bool(out.finite)
    assert out.indices is not None and out.indices.dtype == torch.int32 and out.indices.numel() == k
    assert set(out.indices.tolist()) == top_set(g + e, k)


def test_without_k_the_pass_selects_nothing() -> None:
    grad, residual = heavy(300_000, 0), heavy(300_000, 1)
    assert accumulate_in_place(residual, grad).indices is None


def test_a_half_precision_bucket_accumulates_into_its_fp32_residual() -> None:
    g = heavy(300_000, 0, torch.bfloat16)
    e = torch.rand(300_000, generator=torch.Generator().manual_seed(2)) * 1e-4  # below bf16's resolution next to most of g
    out = accumulate_in_place(e.clone(), g.clone(), 3_000)
    assert out.a.dtype == torch.float32
    assert torch.equal(out.a, g.float() + e)
    assert set(out.indices.tolist()) == top_set(g.float() + e, 3_000)


def test_a_sample_that_misjudges_the_tail_falls_back_to_the_exact_selection() -> None:
    # Large values at every 16th position, so at every sampled one (the stride is a multiple
    # of 16 at 2^20 elements): the sampled threshold lets too few candidates through for k,
    # so the pass selects again.
    numel = 1 << 20
    g = torch.rand(numel)
    g[::16] += 10.0
    k = numel // 8
    out = accumulate_in_place(torch.zeros(numel), g.clone(), k)
    assert set(out.indices.tolist()) == top_set(g, k)


def test_a_nan_makes_the_norm_non_finite() -> None:
    g = heavy(300_000, 0)
    g[12_345] = float("nan")
    out = accumulate_in_place(torch.zeros(300_000), g, 3_000)
    assert not bool(out.finite)


def test_mismatched_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"residual \(10,\) and gradient \(11,\) differ in shape"):
        accumulate_in_place(torch.zeros(10), torch.zeros(11))


def test_the_memory_keeps_one_buffer_per_bucket_and_what_was_not_sent() -> None:
    """sent + residual == a exactly, and the residual is the buffer a was written into (no second copy)."""
    memory = ResidualMemory()
    e = heavy(300_000, 1)
    memory.update(0, LAYOUT, e, torch.empty(0, dtype=torch.int32))
    g = heavy(300_000, 0)
    out = memory.accumulate(0, LAYOUT, g.clone(), 3_000)
    a = g + e
    sent = memory.take(0, out.indices)
    assert torch.equal(sent, a[out.indices.long()])
    memory.commit(0, torch.tensor(True))
    residual = memory.residual(0)
    assert residual.data_ptr() == out.a.data_ptr()
    rebuilt = residual.clone()
    rebuilt[out.indices.long()] += sent
    assert torch.equal(rebuilt, a)


def test_a_non_finite_exchange_drops_the_residual_at_settle() -> None:
    memory = ResidualMemory()
    out = memory.accumulate(0, LAYOUT, heavy(300_000, 0), 3_000)
    memory.take(0, out.indices)
    memory.commit(0, torch.tensor(False))
    assert memory.holds(0)
    memory.settle()
    assert memory.residual(0) is None


def test_a_dropped_residual_leaves_its_buffer_to_the_next_sparse_step_which_ignores_its_contents() -> None:
    memory = ResidualMemory()
    g = heavy(300_000, 0)
    g[7] = float("nan")
    first = memory.accumulate(0, LAYOUT, g.clone(), 3_000)
    memory.take(0, first.indices)
    memory.commit(0, torch.tensor(False))  # the NaN step: the residual is dropped at settle
    memory.settle()
    assert memory.residual(0) is None
    g2 = heavy(300_000, 2)
    second = memory.accumulate(0, LAYOUT, g2.clone(), 3_000)
    assert second.a.data_ptr() == first.a.data_ptr()  # no new gradient-sized allocation
    assert torch.equal(second.a, g2)  # a = g: the NaN left in the buffer is not read
    assert set(second.indices.tolist()) == top_set(g2, 3_000)

