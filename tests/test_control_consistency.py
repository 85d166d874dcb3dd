"""Rank consistency of the decisions (issue 20, cause 6): fingerprint, agreed lengths, resume."""

from __future__ import annotations

from flexcomm.control import DensityController
from multiproc import raised, run_world
from test_hook_distributed import exchange, gradient, hooked_model

# ---------------------------------------------------------------- every decision option in the fingerprint

#: Options that change a decision, and rank 1's value (rank 0 keeps the default).
DIFFERING = {"hysteresis": 0.2, "redecide_every": 7, "gain_change": 0.3, "cost_change": 0.5, "min_gain": 0.3}


def _differing_options(rank: int, world: int) -> str:
    controller = DensityController(**(DIFFERING if rank else {}))
    model, state = hooked_model(compressor="flex", density="auto", controller=controller)
    if rank:
        state.chooser.explore_every = 3
    return raised(lambda: exchange(model, gradient(rank, 0)))


def test_ranks_with_different_decision_options_fail_at_the_first_bucket_naming_each() -> None:
    for message in run_world(_differing_options, 2):
        assert "configuration differs across ranks" in message
        for name, value in DIFFERING.items():
            assert f"controller.{name}: rank 0=" in message and f"rank 1={value!r}" in message
        assert "chooser.explore_every: rank 0=10, rank 1=3" in message
