"""All-dense steps cut short when their first step shows that what chose them was stale.

``flex`` runs every bucket dense (fp32 or dense16) when its measurements say so: the guard's
trials and its all-dense plan (:mod:`flexcomm.control.guard`), or the model's own plan.  Those
measurements can be older than the link.  After a link drop that only small messages crossed
(a sparse or low-rank plan's payloads, below the probes' sizes, do not feed the alpha-beta fit,
:mod:`flexcomm.control.intake`) every one of them still describes the fast link:

* the guard's trial: the model still rated all-dense within ``GUARD_MARGIN`` of the plan, and 3
  fp32 steps ran at 100 Mbit/s, 114-125 ms each against 10 ms for the plan (MLP group with one
  bucket, seeds 1 and 3 at d3fd691, 0.35-0.41 s of 5 s runs);
* the model's plan: the sparse pairs that ran were measured slower after the drop, the dense
  pairs kept their fast-link calibration, and a whole agreement interval ran fp32 dense
  (``tests/fake_link.py``, 10 Gbit/s to 100 Mbit/s: 10 steps of 69 ms against 7 ms).

So the first all-dense step after steps that were not is checked at the next step's start: if
its collectives took over ``JUMP`` times the plan's measured step period, the exchanges of the
last step that was not all-dense run again until the next agreement point, where the dense
step's period and its collective (large enough to feed the fit) are agreed and the plan is made
again.  The collectives' own time (service time, :mod:`flexcomm.control.step_log`) of the rank
that waited least (one allreduce of one float, MIN), not the whole step's period: one rank's
pause in forward or the optimizer does not cut, a slow link slows every rank's collective alike,
and a resumed run reads the same samples from its checkpoint (a period across the restart would
hold the restart).  Whether a step was all-dense follows from the exchanges every rank entered
(the same on every rank), so every rank checks at the same step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flexcomm.control.guard import JUMP
from flexcomm.cost import DENSE_EXCHANGES


class DenseCheck:
    """The exchanges of the last step that was not all-dense, and whether the step just closed began an all-dense stretch."""

    def __init__(self) -> None:
        self._before: dict[int, tuple[str, float]] = {}
        self._all_dense = False

    def closed(self, exchanges: Mapping[int, tuple[str, float]]) -> bool:
        """Fold in the step that just closed (bucket -> (exchange, density) entered; empty: no step).  True when
        it was the first all-dense step after one that was not, at the same density: a new density (``auto``
        chose 1.0) is the controller's to judge, and the exchanges of the step before would not fit it (AG-Topk
        at density 1.0 sends every index too: 720 ms steps at 100 Mbit/s where dense took 120)."""
        if not exchanges:
            return False
        all_dense = {e for e, _ in exchanges.values()} <= DENSE_EXCHANGES
        same_density = {d for _, d in exchanges.values()} == {d for _, d in self._before.values()}
        first = all_dense and not self._all_dense and same_density
        if not all_dense:
            self._before = dict(exchanges)
        self._all_dense = all_dense
        return first

    @property
    def fallback(self) -> dict[int, str]:
        """The exchanges of the last step that was not all-dense."""
        return {b: e for b, (e, _) in self._before.items()}

    def state_dict(self) -> dict[str, Any]:
        return {"dense_before": [[b, e, d] for b, (e, d) in sorted(self._before.items())], "dense_run": self._all_dense}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict` (absent from states saved before it was kept: nothing to check against)."""
        self._before = {int(b): (str(e), float(d)) for b, e, d in state.get("dense_before", [])}
        self._all_dense = bool(state.get("dense_run", False))


#: All-dense steps whose collectives take this many times the plan's measured step period are cut short.
TOO_SLOW = JUMP


def slowdown(seconds: float, plan: tuple[float, int] | None) -> float:
    """``seconds`` over the plan's measured step period (``(seconds, step)``; 0 where none was measured)."""
    return seconds / plan[0] if plan and plan[0] > 0.0 else 0.0
