"""The adaptive engine's mechanism figures, read from a run's records and its controller's decisions.

Issue #20 asks for three besides the exploration share (``adaptive_e2e.exploration_cost_pct``):

* **density switches per 100 steps outside link changes** (goal <= 3): changes of the
  ``density="auto"`` controller's density, from the decision log the run's summary keeps
  (``density_decisions``), not counting those within ``settle`` steps after a rate change
  of the link.  The step records' ``density`` is another quantity -- the densest compressed
  bucket's density, 1.0 when the plan sends every bucket dense -- so it also changes when only
  ``flex``'s exchange plan changes; :func:`plan_changes_per_100` counts those apart.
* **slow agreement intervals after a link change** (goal <= 1): per rate change, how many
  ``interval``-step windows from the change on have a median step time over ``factor`` x the
  best: the fastest median step of the same phase among the static settings of the same seed.
* **prediction error per density** (goal: median <= 20%): at each decision, the controller's
  predicted step period of the density it chose against the median measured period of the
  steps that ran it until the next decision (on the same phase of the link).  A step's period
  is what the controller predicts: the training clock from the previous step's end to this
  one's (``train_wall``: data loading, logging and the step; evaluation left out), not
  ``t_step``, which leaves out the data loading (6-9% of the MLP group's 1 Gbit steps).

Pure functions over :class:`runs.Run`; ``adaptive_e2e.py`` tabulates them.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

from runs import Run, schedule_time


def change_steps(run: Run) -> list[int]:
    """The first step of each phase after the first: the step running when the link's rate changed."""
    changes = (run.network or {}).get("changes") or []
    steps, ends = [], [schedule_time(r) for r in run.records]
    for change in changes[1:]:
        step = next((r["step"] for r, end in zip(run.records, ends) if end >= change["time_s"]), None)
        if step is not None:
            steps.append(step)
    return steps


def density_switches(run: Run, settle: int) -> tuple[float, float] | None:
    """(switches per 100 steps, those outside ``settle`` steps after a link change) of the controller's density;
    None for a run without a density controller."""
    decisions = run.summary.get("density_decisions") if run.summary else None
    if not decisions:
        return None
    switched = [b["step"] for a, b in zip(decisions, decisions[1:]) if a["density"] != b["density"]]
    changes = change_steps(run)
    outside = [s for s in switched if not any(0 <= s - c < settle for c in changes)]
    steps = max(1, len(run.records))
    return 100 * len(switched) / steps, 100 * len(outside) / steps


def plan_changes_per_100(run: Run) -> float:
    """Changes of the recorded step density (the controller's density or the exchange plan's) per 100 steps."""
    densities = [r.get("density") for r in run.records]
    changes = sum(1 for a, b in zip(densities, densities[1:]) if a is not None and b is not None and a != b)
    return 100 * changes / max(1, len(densities))


def phase_medians(run: Run) -> list[float | None]:
    """Median step time of each phase of the link (None where no step ran in it)."""
    bounds = [0, *change_steps(run), len(run.records)]
    times = [r["t_step"] for r in run.records]
    return [statistics.median(times[a:b]) if b > a else None for a, b in zip(bounds, bounds[1:])]


def slow_intervals_after_changes(run: Run, statics: Sequence[Run], interval: int, factor: float = 1.5) -> list[int]:
    """Per link change: windows of ``interval`` steps from the change that ran slower than ``factor`` x the best.

    The best is the fastest static setting's median step in the same phase; counting stops at the
    first window within it (or the phase's end).
    """
    best = [min((m for m in medians if m is not None), default=None)
            for medians in zip(*(phase_medians(s) for s in statics))] if statics else []
    times = [r["t_step"] for r in run.records]
    changes = change_steps(run)
    ends = [*changes[1:], len(times)]
    out = []
    for phase, (start, end) in enumerate(zip(changes, ends), start=1):
        if phase >= len(best) or best[phase] is None:
            continue
        slow = 0
        for a in range(start, end, interval):
            window = times[a:min(a + interval, end)]
            if statistics.median(window) <= factor * best[phase]:
                break
            slow += 1
        out.append(slow)
    return out


def prediction_errors(run: Run) -> dict[float, list[float]]:
    """Per density the controller chose: relative errors ``predicted / measured - 1`` of its predicted step period,
    each against the median period until the next decision, within one phase of the link."""
    decisions = (run.summary or {}).get("density_decisions") or []
    times = {b["step"]: schedule_time(b) - schedule_time(a) for a, b in zip(run.records, run.records[1:])}
    changes = change_steps(run)
    errors: dict[float, list[float]] = {}
    for decision, following in zip(decisions, [*decisions[1:], None]):
        start = decision["step"]
        end = following["step"] if following else max(times, default=start) + 1
        end = min([end, *(c for c in changes if c > start)])
        ran = [times[s] for s in range(start, end) if s in times]
        predicted = _predicted(decision)
        if ran and predicted:
            errors.setdefault(decision["density"], []).append(predicted / statistics.median(ran) - 1.0)
    return errors


def _predicted(decision: dict[str, Any]) -> float | None:
    return next((c["seconds"] for c in decision["candidates"] if c["density"] == decision["density"]), None)
