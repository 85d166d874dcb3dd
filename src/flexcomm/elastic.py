"""Resuming on another number of ranks: what each rank's error-feedback residual becomes.

A job saved by N ranks resumes on M ranks (torchrun ``--nnodes MIN:MAX``, a node lost or
added).  Model and optimizer are the same on every rank and load as usual; the hook's
state splits in two:

* world-size independent, taken from the saved state: the step counter and, under
  ``density="auto"``, the controller's state (the density in force and its last decision);
* world-size dependent, started over and re-agreed by the M ranks: the leader counts and
  statistics (one entry per rank), the cost model and the planner's measurements (timed
  on N ranks, and collectives over them would not match on M).

Residuals.  Rank i's update contribution is ``sent_i / N`` (the hook divides before the
sum), so what error feedback still owes the model is the *pending update*

    P = (1/N) * sum_i e_i,    and    sum_t update_t + P = (1/N) * sum_t sum_i g_{i,t}

at every step: nothing a rank computed is lost or applied twice.  Two policies
(``residuals=``):

``"fold"`` (default)  ``e'_r = (M/N) * sum_{j < N, j mod M = r} e_j``: each remaining rank
                      keeps its own residual and receives those of the departed ranks
                      ``r + M, r + 2M, ...``; new ranks (``r >= N``) start at zero.  Then
                      ``(1/M) * sum_r e'_r = P`` exactly: the invariant above holds across
                      the resize.  The factor ``M/N`` is what makes it exact: without it,
                      4 -> 2 ranks would apply the pending update twice over.
``"drop"``            ``e'_r = e_r`` for ``r < min(N, M)``, new ranks at zero, the departed
                      ranks' residuals dropped.  The pending update becomes the survivors'
                      ``(1/M) * sum_{r<M} e_r`` (shrinking: their mean, the departed share
                      lost) or ``(N/M) * P`` (growing).

``"fold"`` is the default because it loses nothing: at density d a residual holds up to
about ``1/d`` steps of the coordinates not yet sent, and dropping it is a gradient step's
worth of error the run never recovers.  Its cost: a rank loads the saved states of the
ranks folded into it (:func:`sources` names them).  Either way a rank's residual comes
from its own saved state (plus, folded and labelled, the departed ranks'): a rank never
loads another rank's residual as its own.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flexcomm.state import FlexState

RESIDUAL_POLICIES = ("fold", "drop")


class ElasticResumeWarning(UserWarning):
    """A state saved at another world size was loaded: says what was kept, folded, dropped and reset."""


def sources(rank: int, world_size: int, saved_world_size: int) -> tuple[int, list[int]]:
    """``(saved rank whose state this rank loads, departed ranks folded into it)``.

    A remaining rank (``rank < saved_world_size``) loads its own state and, shrinking,
    folds in ranks ``rank + M, rank + 2M, ... < N``; a new rank loads rank 0's state for its
    world-size independent parts only (its residuals start at zero).
    """
    for name, value in (("world_size", world_size), ("saved_world_size", saved_world_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank!r}")
    if rank >= saved_world_size:
        return 0, []
    return rank, list(range(rank + world_size, saved_world_size, world_size))


def load_resized(
    flex: FlexState, state: dict[str, Any], departed_states: Sequence[dict[str, Any]], residuals: str,
) -> None:
    """Load a state saved at another world size into ``flex``, a state that has not run a step.

    Residuals per :func:`resized_residuals`; the step counter and the controller from
    ``state``.  Leaders, planner and cost model stay as built (empty): every rank starts
    them over alike for the new world size.  Ends with one :class:`ElasticResumeWarning`.
    """
    saved_controller = state["planner"]["controller"]
    if (saved_controller is None) != (flex.controller is None):
        raise ValueError("checkpoint and this run disagree on density='auto'")
    memory, residual_note = resized_residuals(state, departed_states, flex.rank, flex.world_size, residuals)
    if flex.controller:
        flex.controller.load_state_dict(saved_controller)
    if memory is not None:
        flex.memory.load_state_dict(memory)
    flex.step = int(state["step"])
    warnings.warn(
        f"flexcomm: a state saved by {_ranks(state['world_size'])} resumes on {_ranks(flex.world_size)} at step "
        f"{flex.step}: {residual_note}; kept: the step counter and the density in force ({flex.density:g}); "
        "started over for the new world size: leader counts and statistics, cost model, measurements",
        ElasticResumeWarning, stacklevel=3,
    )


def _ranks(count: int) -> str:
    return f"{count} rank" if count == 1 else f"{count} ranks"


def resized_residuals(
    state: dict[str, Any], departed_states: Sequence[dict[str, Any]], rank: int, world_size: int, residuals: str,
) -> tuple[dict[str, Any] | None, str]:
    """This rank's residual memory state after a resize (``None``: start at zero), and what was done, in words.

    ``state`` is :func:`sources`'s first entry, ``departed_states`` the saved states of its
    second (needed by ``"fold"`` only).
    """
    if residuals not in RESIDUAL_POLICIES:
        raise ValueError(f"residuals must be one of {', '.join(RESIDUAL_POLICIES)}; got {residuals!r}")
    saved_world = int(state["world_size"])
    own, departed = sources(rank, world_size, saved_world)
    if rank >= saved_world:
        return None, f"rank {rank} is new: its error-feedback residuals start at zero"
    if state["rank"] != own:
        raise ValueError(
            f"this FlexState checkpoint belongs to rank {state['rank']} of {saved_world}, but rank {rank} is one of the "
            f"ranks that remain: it must load its own saved state (rank {own}), residuals are per rank"
        )
    if residuals == "drop":
        dropped = f"; the residuals of departed ranks {departed} are dropped (residuals='drop')" if departed else ""
        return state["memory"], f"rank {rank} keeps its own error-feedback residuals unchanged{dropped}"
    _check_departed(state, departed_states, departed, rank, world_size)
    by_rank = {int(s["rank"]): s["memory"] for s in departed_states}
    scale = world_size / saved_world
    memory = fold_memory([state["memory"], *(by_rank[j] for j in departed)], scale)
    folded = f" plus those of departed ranks {departed}" if departed else ""
    return memory, (
        f"rank {rank} keeps its own error-feedback residuals{folded}, scaled by {world_size}/{saved_world} so that the "
        "pending update (1/N) * sum of residuals is unchanged (residuals='fold')"
    )


def _check_departed(
    state: dict[str, Any], given: Sequence[dict[str, Any]], expected: list[int], rank: int, world_size: int,
) -> None:
    """``given`` must be exactly the saved states of the ranks ``expected``, from the same checkpoint."""
    ranks = sorted(int(s["rank"]) for s in given)
    if ranks == expected:
        for other in given:
            for key in ("world_size", "step", "compressor"):
                if other[key] != state[key]:
                    raise ValueError(
                        f"the departed rank {other['rank']}'s state has {key}={other[key]!r}, rank {state['rank']}'s "
                        f"has {state[key]!r}: fold states of one checkpoint"
                    )
        return
    raise ValueError(
        f"rank {rank} of {world_size} folds in the residuals of departed ranks {expected} (saved by "
        f"{state['world_size']} ranks), but was given the states of ranks {ranks}: pass exactly those "
        "(flexcomm.elastic.sources names them), or residuals='drop' to drop them"
    )


def fold_memory(memories: Sequence[dict[str, Any]], scale: float) -> dict[str, Any]:
    """``scale * sum`` of :meth:`~flexcomm.compress.ResidualMemory.state_dict` states, key by key.

    Named states add per parameter (a key missing from a state counts as zero); anonymous
    ones per bucket, whose layouts must agree (DDP buckets the same way on every rank).
    """
    named = {bool(m["named"]) for m in memories}
    if len(named) != 1:
        raise ValueError("cannot fold residuals stored per parameter name with ones stored per anonymous bucket")
    if named.pop():
        return {"named": True, "pieces": _scaled_sum([m["pieces"] for m in memories], scale)}
    layouts: dict[Any, Any] = {}
    for m in memories:
        for index, layout in m["layouts"].items():
            if layouts.setdefault(index, layout) != layout:
                raise ValueError(f"bucket {index} has different layouts on the saved ranks: its residuals cannot be folded")
    return {"named": False, "residuals": _scaled_sum([m["residuals"] for m in memories], scale), "layouts": layouts}


def _scaled_sum(parts: Sequence[dict[Any, Any]], scale: float) -> dict[Any, Any]:
    total: dict[Any, Any] = {}
    for part in parts:
        for key, tensor in part.items():
            if key in total and total[key].shape != tensor.shape:
                raise ValueError(f"residual {key!r} has shapes {tuple(total[key].shape)} and {tuple(tensor.shape)} on the saved ranks")
            total[key] = tensor.clone() if key not in total else total[key].add_(tensor)
    # Scaled in place, so the result holds no tensor of the caller's states.
    return {key: tensor.mul_(scale) for key, tensor in total.items()}
