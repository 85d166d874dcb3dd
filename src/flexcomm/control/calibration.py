"""The calibration of ``flex``'s cost model per (bucket, exchange): measured over modelled comm time.

``kappa[b, e]`` is the EWMA of measured / modelled comm seconds of a pair (for an unmeasured
pair the mean over the exchange's other buckets, else 1).  At every agreement point the
estimator refits (alpha, beta); a pair measured since the previous refit has its ``kappa``
rebased so that its prediction at the density it was measured at stays what it measured
(:meth:`Calibration.rebase`; without: dense at 1 Gbit predicted 124 ms while it measured
220 ms), and that prediction is its ``anchor``.  The others follow the model, so a link that
changed moves the exchanges flex is not using (rebasing those too kept dense at its 1 Gbit time
after a drop to 20 Mbit: 4 s steps).  The ratios are plain EWMAs: the plan's own pairs are
measured every step and follow a change within one interval, and one slow sample on a busy CPU
does not flip a plan.  (Taking two ratios in a row 3x off the same way whole, as a regime
change, was tried: on the MLP group it reached the target later, median 1.36-1.41x the fastest
static setting in two repeats against 1.18x without, and ran more dense16 steps across link
changes.)

Plain Python on agreed inputs in a fixed order: every rank holds the same tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from flexcomm.control.tables import drop_buckets, own_or_mean, pairs, unpairs

Pair = tuple[int, str]
#: ``modelled(bucket, exchange, density, world, params)``: the model's uncalibrated comm seconds.
Modelled = Callable[[int, str, float, int, Any], float]


class Calibration:
    """``kappa`` per pair, where each was last measured, what it measured, and which were measured lately.

    Args:
        smoothing: EWMA factor of the ratios (weight of the old value).
    """

    def __init__(self, smoothing: float) -> None:
        self.smoothing = smoothing
        self.kappa: dict[Pair, float] = {}
        #: (density, world size) of each pair's last measurement: where a refit must not move its prediction.
        self.measured_at: dict[Pair, tuple[float, int]] = {}
        #: Calibrated comm seconds of each pair at its last measurement (its own density and world size).
        self.anchor: dict[Pair, float] = {}
        # Pairs measured since the last rebase (a refit must not move them), and in the interval before it.
        self._fresh: set[Pair] = set()
        self._recent: set[Pair] = set()

    def observe(self, key: Pair, ratio: float, density: float, world: int) -> None:
        """Fold a measured / modelled ratio in (EWMA), noting where it was measured."""
        self.measured_at[key] = (density, world)
        self._fresh.add(key)
        old = self.kappa.get(key)
        self.kappa[key] = ratio if old is None else self.smoothing * old + (1.0 - self.smoothing) * ratio

    def of(self, bucket: int, exchange: str) -> float:
        return own_or_mean(self.kappa, bucket, exchange)

    def rebase(self, modelled: Modelled, old_params: Any, new_params: Any, buckets: set[int]) -> None:
        """The refit from ``old_params`` to ``new_params``: every pair of ``buckets`` measured since the last
        rebase keeps its calibrated prediction (its anchor) at the density it was measured at."""
        for key, (density, world) in sorted(self.measured_at.items()):
            bucket, exchange = key
            if bucket not in buckets or key not in self._fresh:
                continue
            before = modelled(bucket, exchange, density, world, old_params)
            after = modelled(bucket, exchange, density, world, new_params)
            if before > 0.0 and after > 0.0:
                self.kappa[key] *= before / after
                self.anchor[key] = self.kappa[key] * after
        self._recent = set(self._fresh)
        self._fresh.clear()

    def forget(self, buckets: set[int]) -> None:
        """Drop every pair of ``buckets``."""
        for table in (self.kappa, self.measured_at, self.anchor):
            drop_buckets(table, buckets)
        self._fresh = {key for key in self._fresh if key[0] not in buckets}
        self._recent = {key for key in self._recent if key[0] not in buckets}

    def recent(self, key: Pair) -> bool:
        """Whether the pair was measured in the interval before the last rebase (a plan may adopt it on its numbers)."""
        return key in self._recent

    def state_dict(self) -> dict[str, Any]:
        return {"kappa": pairs(self.kappa), "kappa_at": pairs(self.measured_at), "anchor": pairs(self.anchor),
                "fresh": sorted([b, e] for b, e in self._fresh), "recent": sorted([b, e] for b, e in self._recent)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Keys absent from older checkpoints load empty (the pairs are then simply recalibrated)."""
        self.kappa = unpairs(state["kappa"])
        self.measured_at = {key: (float(d), int(w)) for key, (d, w) in unpairs(state.get("kappa_at", [])).items()}
        self.anchor = {key: float(v) for key, v in unpairs(state.get("anchor", [])).items()}
        self._fresh = {(int(b), str(e)) for b, e in state.get("fresh", [])}
        self._recent = {(int(b), str(e)) for b, e in state.get("recent", [])}
