"""Which exchange a bucket uses: the cheapest by the alpha-beta model plus compression time.

For a bucket of M elements at density c on N ranks the predicted step cost is

    dense:   T_allreduce(M * vb)
    agtopk:  T_allgather(k * (vb + 4))                      + t_comp
    artopk:  T_broadcast(k * 4) + T_allreduce(k * vb)       + t_comp

with the collectives' (alpha, beta) from the online estimator and ``t_comp`` the
bucket's measured top-k selection time (an EWMA of the max over ranks: the selection is
on the critical path).  ``t_comp`` starts at 0, an optimistic guess that corrects itself:
if compression looks cheapest it runs and gets measured; if dense wins with t_comp = 0 it
wins with any t_comp.

Hysteresis: a bucket keeps its current exchange unless another is predicted faster by
more than ``hysteresis`` (10%): near-ties are decided by timing noise, and flipping
between them costs more than it saves.

The chooser is a deterministic function of its inputs and its own past choices; every
rank feeds it the same (agreed) inputs at the same steps, so every rank picks the same.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flexcomm.cost import CostEstimator, CostParams, predict_exchange_times


@dataclass(frozen=True)
class Choice:
    exchange: str
    predicted: dict[str, float]


class ExchangeChooser:
    """Cheapest exchange per bucket; its inputs change only at :meth:`refresh`."""

    def __init__(self, estimator: CostEstimator | None = None, compress_smoothing: float = 0.7, hysteresis: float = 0.1) -> None:
        self.estimator = estimator or CostEstimator()
        self.compress_smoothing = compress_smoothing
        self.hysteresis = hysteresis
        self.params: CostParams = self.estimator.params
        self._compress_seconds: dict[int, float] = {}
        self._current: dict[int, str] = {}

    def observe_compression(self, bucket_index: int, seconds: float) -> None:
        previous = self._compress_seconds.get(bucket_index)
        s = self.compress_smoothing
        self._compress_seconds[bucket_index] = seconds if previous is None else s * previous + (1 - s) * seconds

    def refresh(self) -> None:
        """Take the estimator's current (alpha, beta) for the next decisions."""
        self.params = self.estimator.params

    def choose(self, bucket_index: int, numel: int, density: float, world_size: int, value_bytes: int) -> Choice:
        predicted = predict_exchange_times(numel, density, world_size, self.params, value_bytes)
        t_comp = self._compress_seconds.get(bucket_index, 0.0)
        predicted["agtopk"] += t_comp
        predicted["artopk"] += t_comp
        # Ties go to the simplest exchange (dict order: dense, artopk, agtopk).
        exchange = min(predicted, key=predicted.__getitem__)
        current = self._current.get(bucket_index)
        if current is not None and predicted[current] <= predicted[exchange] * (1.0 + self.hysteresis):
            exchange = current
        return Choice(exchange, predicted)

    def keep(self, bucket_index: int, exchange: str) -> None:
        """Record the exchange a bucket now uses (the reference point of the hysteresis)."""
        self._current[bucket_index] = exchange

    def predicted_seconds(self, bucket_index: int, numel: int, density: float, world_size: int, value_bytes: int, exchange: str | None) -> float:
        """Predicted time of one bucket at ``density``: with ``exchange``, or the cheapest if None.

        Density 1.0 is always a dense exchange: sending every index would only add bytes.
        """
        if density >= 1.0:
            exchange = "dense"
        choice = self.choose(bucket_index, numel, density, world_size, value_bytes)
        return choice.predicted[exchange or choice.exchange]

    def state_dict(self) -> dict[str, Any]:
        return {"estimator": self.estimator.state_dict(), "compress_seconds": dict(self._compress_seconds),
                "current": dict(self._current)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.estimator.load_state_dict(state["estimator"])
        self._compress_seconds = {int(i): float(s) for i, s in state["compress_seconds"].items()}
        self._current = {int(i): str(e) for i, e in state["current"].items()}
        self.refresh()
