"""Compression math on single tensors: selection, packing, error-feedback memory."""

from __future__ import annotations

import pytest
import torch

from flexcomm.compress import ResidualMemory, TopkWorkspace, k_for, mstopk_indices, pack, topk_indices, unpack_all
from flexcomm.compress import topk as topk_module


def reference_set(x: torch.Tensor, k: int) -> set[int]:
    return set(torch.topk(x.abs(), k).indices.tolist())


@pytest.mark.parametrize("numel,density", [(10, 0.3), (70_000, 0.001), (300_000, 0.01), (300_000, 0.1), (200_000, 0.2)])
def test_topk_equals_torch_topk(numel: int, density: float) -> None:
    x = torch.randn(numel, generator=torch.Generator().manual_seed(numel))
    k = k_for(numel, density)
    got = topk_indices(x, k, TopkWorkspace())
    assert got.dtype == torch.int32
    assert got.numel() == k
    assert set(got.tolist()) == reference_set(x, k)


def test_topk_fast_path_is_taken_and_exact_on_heavy_tails() -> None:
    # Heavy-tailed magnitudes, like real gradients: a few huge values, a sea of tiny ones.
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(400_000, generator=gen) * torch.rand(400_000, generator=gen).pow(8)
    k = k_for(x.numel(), 0.001)
    assert topk_module.fast_path_applies(x, k)
    assert topk_module._candidate_topk(x, k, TopkWorkspace()) is not None
    assert set(topk_indices(x, k).tolist()) == reference_set(x, k)


def test_topk_falls_back_when_the_sample_misjudges_the_tail() -> None:
    # Every sampled position is zero, the large values sit between the samples: the
    # sampled threshold is 0, all pass, and a threshold > all values would be wrong.
    x = torch.zeros(1 << 17)
    x[1::2] = torch.arange(1, (1 << 16) + 1, dtype=torch.float32)
    k = 100
    assert set(topk_indices(x, k).tolist()) == reference_set(x, k)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_topk_other_dtypes(dtype: torch.dtype) -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(1)).to(dtype)
    k = 100
    # Half-precision ties are common: compare the selected magnitudes, not the index sets.
    got = x.abs()[topk_indices(x, k).long()].sort().values
    torch.testing.assert_close(got, torch.topk(x.abs(), k).values.sort().values, rtol=0, atol=0)


def test_topk_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError, match="flat tensor"):
        topk_indices(torch.ones(2, 2), 1)
    with pytest.raises(ValueError, match=r"k must be in \[1, 4\], got 5"):
        topk_indices(torch.ones(4), 5)


def test_k_for() -> None:
    assert k_for(1000, 0.01) == 10
    assert k_for(1001, 0.01) == 11  # ceil
    assert k_for(10, 1e-9) == 1  # never zero
    assert k_for(10, 1.0) == 10


def test_mstopk_selects_k_close_to_the_exact_top_k() -> None:
    x = torch.randn(1_000_000, generator=torch.Generator().manual_seed(7))
    k = k_for(x.numel(), 0.01)
    got = mstopk_indices(x, k, rounds=20)
    # Exactly k whenever the final band holds enough elements (it does for continuous data).
    assert got.numel() == k
    assert len(set(got.tolist())) == k
    # After 20 halvings of [mean, max] the band is ~4e-6 wide: only elements that tie with
    # the k-th value within that width can be swapped, so the overlap is near total.
    overlap = len(set(got.tolist()) & reference_set(x, k)) / k
    assert overlap > 0.99


def test_mstopk_with_few_rounds_is_approximate_but_exactly_k() -> None:
    x = torch.randn(100_000, generator=torch.Generator().manual_seed(8))
    k = 1000
    got = mstopk_indices(x, k, rounds=2)
    assert got.numel() == k
    assert len(set(got.tolist())) == k


def test_mstopk_rejects_bad_rounds() -> None:
    with pytest.raises(ValueError, match="rounds must be >= 1, got 0"):
        mstopk_indices(torch.ones(4), 1, rounds=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_pack_unpack_round_trip(dtype: torch.dtype) -> None:
    world, k = 3, 5
    messages, expected = [], []
    for r in range(world):
        values = torch.randn(k).to(dtype)
        indices = torch.arange(k, dtype=torch.int32) * (r + 1)
        messages.append(pack(values, indices))
        expected.append((values, indices))
    values, indices = unpack_all(torch.cat(messages), world, k, dtype)
    assert torch.equal(values, torch.cat([v for v, _ in expected]))
    assert torch.equal(indices, torch.cat([i for _, i in expected]))


def test_pack_rejects_mismatched_lengths() -> None:
    with pytest.raises(ValueError, match="3 values but 2 indices"):
        pack(torch.ones(3), torch.zeros(2, dtype=torch.int32))


def test_residual_memory_keeps_what_was_not_sent() -> None:
    memory = ResidualMemory()
    layout = (("w", 6),)
    g = torch.tensor([1.0, -5.0, 2.0, 0.5, 4.0, -1.0])
    accumulated = memory.compensate(0, layout, g.clone())
    sent = torch.tensor([1, 4], dtype=torch.int32)
    memory.update(0, layout, accumulated, sent)
    residual = memory.residual(0)
    assert residual.tolist() == [1.0, 0.0, 2.0, 0.5, 0.0, -1.0]
    sent_part = torch.zeros(6)
    sent_part[sent.long()] = accumulated[sent.long()]
    assert torch.equal(sent_part + residual, accumulated)
    # Next step: a = g + e.
    assert memory.compensate(0, layout, torch.ones(6)).tolist() == [2.0, 1.0, 3.0, 1.5, 1.0, 0.0]


def test_anonymous_memory_drops_a_residual_whose_bucket_changed_layout() -> None:
    memory = ResidualMemory()
    memory.update(0, (("(6,)", 6),), torch.ones(6), torch.tensor([0], dtype=torch.int32))
    g = torch.ones(6)
    assert torch.equal(memory.compensate(0, (("(2,)", 2), ("(4,)", 4)), g.clone()), g)
    assert memory.residual(0) is None


def test_named_memory_moves_residuals_with_their_parameters_when_buckets_are_rebuilt() -> None:
    memory = ResidualMemory(named=True)
    # Initial layout: bucket 0 = [a(2), b(3)], bucket 1 = [c(1)].
    memory.update(0, (("a", 2), ("b", 3)), torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), torch.tensor([4], dtype=torch.int32))
    memory.update(1, (("c", 1),), torch.tensor([7.0]), torch.tensor([], dtype=torch.int32))
    # Rebuilt: bucket 0 = [c, b], bucket 1 = [a].
    assert memory.compensate(0, (("c", 1), ("b", 3)), torch.zeros(4)).tolist() == [7.0, 3.0, 4.0, 0.0]
    assert memory.compensate(1, (("a", 2),), torch.zeros(2)).tolist() == [1.0, 2.0]


def test_named_state_dict_restores_under_another_bucket_layout() -> None:
    memory = ResidualMemory(named=True)
    memory.update(0, (("a", 2), ("b", 2)), torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0], dtype=torch.int32))
    restored = ResidualMemory(named=True)
    restored.load_state_dict(memory.state_dict())
    assert restored.compensate(5, (("b", 2),), torch.zeros(2)).tolist() == [3.0, 4.0]
    assert restored.compensate(2, (("a", 2),), torch.zeros(2)).tolist() == [0.0, 2.0]
    with pytest.raises(ValueError, match="stored per parameter name, but this run's hook was registered without"):
        ResidualMemory().load_state_dict(memory.state_dict())


def test_residual_memory_state_dict_round_trip() -> None:
    memory = ResidualMemory()
    layout = (("(4,)", 4),)
    memory.update(3, layout, torch.arange(4.0), torch.tensor([3], dtype=torch.int32))
    restored = ResidualMemory()
    restored.load_state_dict(memory.state_dict())
    assert torch.equal(restored.residual(3), torch.tensor([0.0, 1.0, 2.0, 0.0]))
    assert torch.equal(restored.compensate(3, layout, torch.zeros(4)), torch.tensor([0.0, 1.0, 2.0, 0.0]))

