"""Resuming on another number of ranks (flexcomm.elastic), on real gloo groups.

A job trains on N ranks and gathers every rank's state as the integrations do; a new job
of M ranks loads it with :func:`flexcomm.rank_states.load_own_rank_state` and trains on.
Checked: the step counter continues, the residuals follow the policy (fold: the pending
update ``sum(e) / N`` is unchanged), one warning per rank says what happened, and the
resumed ranks' collectives match (they train on and stay replicas).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from flexcomm import elastic
from flexcomm.rank_states import load_own_rank_state
from multiproc import run_world
from test_reliability import _mlp, _train_steps

SAVED_AT, MORE = 6, 4


def _model_and_state(compressor: str, density: float | str) -> tuple[DDP, torch.optim.Optimizer, flexcomm.FlexState]:
    model = DDP(_mlp())
    state = flexcomm.register(model, compressor=compressor, density=density)
    return model, torch.optim.SGD(model.parameters(), lr=0.05), state


def _save(rank: int, world: int, compressor: str, density: float | str) -> dict:
    model, opt, state = _model_and_state(compressor, density)
    _train_steps(model, opt, rank, range(SAVED_AT))
    return {"flex": state.state_dict(), "model": {k: v.clone() for k, v in model.module.state_dict().items()}}


def _resume(rank: int, world: int, saved: list[dict], compressor: str, density: float | str, residuals: str) -> dict:
    model, opt, state = _model_and_state(compressor, density)
    model.module.load_state_dict(saved[0]["model"])  # replicas: any rank's model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_own_rank_state(state, [s["flex"] for s in saved], residuals=residuals)
    loaded = state.memory.state_dict()["pieces"]
    density_loaded, step_loaded = state.density, state.step
    _train_steps(model, opt, rank, range(SAVED_AT, SAVED_AT + MORE))
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    replicas = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(replicas, params)
    return {
        "warnings": [str(w.message) for w in caught if issubclass(w.category, elastic.ElasticResumeWarning)],
        "pieces": loaded, "step_loaded": step_loaded, "density_loaded": density_loaded, "step": state.step,
        "replicas": all(torch.equal(r, params) for r in replicas), "steps_recorded": {r.step for r in state.drain_records()},
    }


def _pending(pieces_by_rank: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The pending update ``sum_i e_i / N`` per parameter."""
    keys = {key for pieces in pieces_by_rank for key in pieces}
    return {key: sum(p[key] for p in pieces_by_rank if key in p) / len(pieces_by_rank) for key in keys}


def _check_continued(results: list[dict], saved: list[dict]) -> None:
    for result in results:
        assert result["step_loaded"] == SAVED_AT and result["step"] == SAVED_AT + MORE
        assert result["steps_recorded"] == set(range(SAVED_AT, SAVED_AT + MORE))  # no second step 0
        assert result["replicas"] and len(result["warnings"]) == 1
        assert result["density_loaded"] == saved[0]["flex"]["density"]


def test_fewer_ranks_fold_the_departed_residuals_artopk_star() -> None:
    saved = run_world(_save, 3, "artopk-star", 0.05)
    results = run_world(_resume, 2, saved, "artopk-star", 0.05, "fold")
    _check_continued(results, saved)
    before = [s["flex"]["memory"]["pieces"] for s in saved]
    after = [r["pieces"] for r in results]
    assert all(sum(float(p.abs().sum()) for p in pieces.values()) > 0 for pieces in before)
    pending_after = _pending(after)
    for key, pending in _pending(before).items():
        torch.testing.assert_close(pending_after[key], pending)
    for key, piece in after[1].items():  # rank 1 keeps its own, scaled: no departed rank is 1 mod 2
        torch.testing.assert_close(piece, before[1][key] * 2 / 3)
    assert "plus those of departed ranks [2], scaled by 2/3" in results[0]["warnings"][0]
    assert "saved by 3 ranks resumes on 2 ranks at step 6" in results[0]["warnings"][0]


def test_more_ranks_keep_the_density_new_rank_starts_at_zero_flex_auto() -> None:
    saved = run_world(_save, 2, "flex", "auto")
    results = run_world(_resume, 3, saved, "flex", "auto", "fold")
    _check_continued(results, saved)
    assert results[2]["pieces"] == {}
    assert "rank 2 is new: its error-feedback residuals start at zero" in results[2]["warnings"][0]
    assert "density in force" in results[0]["warnings"][0]


# ---------------------------------------------------------------- the policy itself, no group

def _state(rank: int, world: int, pieces: dict[str, torch.Tensor], step: int = 5) -> dict:
    return {"rank": rank, "world_size": world, "step": step, "compressor": "agtopk",
            "memory": {"named": True, "pieces": pieces}}


SAVED = [_state(r, 4, {"w": torch.full((3,), float(r + 1))}) for r in range(4)]


def test_sources_name_own_state_and_departed_ranks() -> None:
    assert elastic.sources(1, 2, 5) == (1, [3])
    assert elastic.sources(0, 2, 5) == (0, [2, 4])
    assert elastic.sources(3, 4, 2) == (0, [])  # a new rank: rank 0's step and controller
    with pytest.raises(ValueError, match=r"rank must be in \[0, 2\)"):
        elastic.sources(2, 2, 4)


def test_fold_sums_departed_residuals_scaled_to_keep_the_pending_update() -> None:
    memory, note = elastic.resized_residuals(SAVED[0], [SAVED[2]], rank=0, world_size=2, residuals="fold")
    assert torch.equal(memory["pieces"]["w"], torch.full((3,), (1.0 + 3.0) * 2 / 4))
    assert torch.equal(SAVED[0]["memory"]["pieces"]["w"], torch.full((3,), 1.0))  # the saved state is untouched
    assert "plus those of departed ranks [2]" in note


def test_drop_keeps_own_residual_unchanged() -> None:
    memory, note = elastic.resized_residuals(SAVED[1], [], rank=1, world_size=2, residuals="drop")
    assert memory is SAVED[1]["memory"] and "departed ranks [3] are dropped" in note


@pytest.mark.parametrize(
    ("state", "departed", "message"),
    [
        (SAVED[0], [], r"folds in the residuals of departed ranks \[2\].*given the states of ranks \[\]"),
        (SAVED[0], [SAVED[3]], r"given the states of ranks \[3\]"),
        (SAVED[1], [SAVED[3]], "belongs to rank 1 of 4, but rank 0 is one of the ranks that remain"),
        (SAVED[0], [_state(2, 4, {}, step=9)], "has step=9"),
    ],
)
def test_bad_inputs_are_refused_naming_the_ranks(state: dict, departed: list, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        elastic.resized_residuals(state, departed, rank=0, world_size=2, residuals="fold")


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="residuals must be one of fold, drop"):
        elastic.resized_residuals(SAVED[0], [], rank=0, world_size=2, residuals="sum")
