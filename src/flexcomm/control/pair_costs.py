"""What each (bucket, exchange) pair costs ``flex``: its measurements and the predictions made from them.

A bucket's :class:`~flexcomm.control.step_model.BucketCosts` at a density, for every exchange:

* ``comm``: the alpha-beta model times the calibration ``kappa[b, e]`` of
  :mod:`flexcomm.control.calibration` (measured over modelled, rebased at every refit for the
  pairs measured since the last one); infinity where the exchange cannot help the bucket;
* ``block``: the pair's measured local work; for an unmeasured sparse pair the measured seconds
  per element of sparse exchanges on other buckets scaled to this one; 0 for unmeasured dense16
  and low-rank pairs and for sparse ones before any measurement (optimistic: they get tried);
* ``gap``: the measured backward time after the bucket until the next one is handed over;
* the steps factors: AR-Topk's from the energy fractions its followers sent
  (:mod:`flexcomm.control.quality`), low-rank's ``1 / quality`` from its measured cosine.

Measurements are plain EWMAs: the plan's own pairs follow a change within one interval, single
slow samples (frequent on a busy CPU) do not flip a plan.  A bucket's costs are kept until one of
their inputs changes (a refit, agreed samples, a new size or low-rank payload, a forgotten
bucket, a loaded state): every bucket of every step asks for them, the inputs change only at
agreement points.

Plain Python on agreed inputs in a fixed order: every rank holds the same tables.
"""

from __future__ import annotations

import math
from typing import Any

from flexcomm.control.calibration import Calibration
from flexcomm.control.measurements import StepSample
from flexcomm.control.quality import quality_factor, steps_factor
from flexcomm.control.step_model import EXCHANGE_ORDER, LOW_RANK, SPARSE, BucketCosts
from flexcomm.control.tables import drop_buckets, own_or_mean, pairs, unpairs
from flexcomm.cost import HALF_BYTES, CostEstimator, CostParams, lowrank_time, predict_exchange_times


class PairCosts:
    """Measured and modelled costs per (bucket, exchange).

    Args:
        estimator: the online (alpha, beta) estimate; its parameters are taken at :meth:`refresh`.
        smoothing: EWMA factor of the measurements (weight of the old value).
        dense16: whether ``dense16`` (the bucket allreduced in fp16) can be used.
        lowrank: whether ``lowrank`` (rank-r factors, two allreduces) can be used.
    """

    def __init__(self, estimator: CostEstimator, smoothing: float, dense16: bool, lowrank: bool) -> None:
        self.estimator = estimator
        self.params: CostParams = estimator.params
        self.smoothing = smoothing
        self.dense16 = dense16
        self.lowrank = lowrank
        #: bucket -> (numel, value bytes) of the buckets of the current layout.
        self.sizes: dict[int, tuple[int, int]] = {}
        #: bucket -> elements of the low-rank exchange's two allreduces (absent: nothing to factor).
        self.factor_sizes: dict[int, tuple[int, int]] = {}
        self.calibration = Calibration(smoothing)
        #: pair -> the step of its last agreed measurement.
        self.measured_step: dict[tuple[int, str], int] = {}
        self._block: dict[tuple[int, str], float] = {}
        self._gap: dict[int, float] = {}
        # Steps factor of AR-Topk pairs (EWMA): the followers send less than their own top-k.
        self._factor: dict[tuple[int, str], float] = {}
        # cos(update, mean gradient) of low-rank pairs (EWMA): their steps factor.
        self._quality: dict[tuple[int, str], float] = {}
        self._costs: dict[tuple[int, float, int], BucketCosts] = {}

    @property
    def order(self) -> list[int]:
        """The buckets in hook order (DDP hands them over by index)."""
        return sorted(self.sizes)

    def refresh(self) -> None:
        """Take the estimator's current (alpha, beta) for the next predictions (at agreement points).

        The calibration of every pair measured since the last refresh is rebased to the new
        parameters, so that its prediction at the density it was measured at stays what the
        measurements made it; the others follow the model.
        """
        params = self.estimator.params
        self._costs.clear()
        self.calibration.rebase(lambda b, e, d, w, p: self.modelled(b, d, w, p)[e], self.params, params, set(self.sizes))
        self.params = params

    def observe(self, step: int, sample: StepSample, world: int) -> None:
        """Fold one agreed sample in (same order on every rank)."""
        self._costs.clear()
        key = (sample.bucket, sample.exchange)
        model = self.modelled(sample.bucket, sample.density, world, self.params)[sample.exchange]
        self.calibration.observe(key, sample.comm / model if model > 0 else 1.0, sample.density, world)
        self._smooth(self._block, key, sample.block)
        self._smooth(self._gap, sample.bucket, sample.gap)
        self.measured_step[key] = step
        factor = steps_factor(sample.kept_min, sample.kept_max) if sample.exchange == "artopk" else None
        if factor is not None:
            self._smooth(self._factor, key, factor)
        if sample.exchange == LOW_RANK and math.isfinite(sample.quality):
            self._smooth(self._quality, key, sample.quality)

    def _smooth(self, table: dict, key: Any, value: float) -> None:
        old = table.get(key)
        table[key] = value if old is None else self.smoothing * old + (1.0 - self.smoothing) * value

    def modelled(self, bucket: int, density: float, world: int, params: CostParams) -> dict[str, float]:
        """The alpha-beta model's comm seconds of every exchange of ``bucket`` (uncalibrated)."""
        numel, vb = self.sizes[bucket]
        modelled: dict[str, float] = dict(predict_exchange_times(numel, density, world, params, vb))
        payload = self.factor_sizes.get(bucket)
        modelled[LOW_RANK] = lowrank_time(*payload, world, params) if payload else math.inf
        return modelled

    def costs(self, bucket: int, density: float, world: int) -> BucketCosts:
        """Predicted blocking and comm seconds of every exchange of ``bucket`` at ``density``."""
        key = (bucket, density, world)
        cached = self._costs.get(key)
        if cached is None:
            cached = self._costs[key] = self._costs_now(bucket, density, world)
        return cached

    def _costs_now(self, bucket: int, density: float, world: int) -> BucketCosts:
        numel, vb = self.sizes[bucket]
        modelled = self.modelled(bucket, density, world, self.params)
        comm = {e: self.calibration.of(bucket, e) * modelled[e] if self._usable(bucket, e, vb, density) else math.inf
                for e in EXCHANGE_ORDER}
        block = {e: self._block_for(bucket, e, numel) for e in EXCHANGE_ORDER}
        factors = {"artopk": own_or_mean(self._factor, bucket, "artopk"),
                   LOW_RANK: quality_factor(own_or_mean(self._quality, bucket, LOW_RANK))}
        return BucketCosts(block, comm, self._gap.get(bucket, 0.0), factors, float(numel))

    def step_costs(self, density: float, world: int) -> list[BucketCosts]:
        return [self.costs(b, density, world) for b in self.order]

    def _usable(self, bucket: int, exchange: str, value_bytes: int, density: float) -> bool:
        """Whether ``exchange`` can help: sparse ones below density 1 (sending every index only adds bytes),
        ``dense16`` when enabled and the gradient is wider than 16 bits, ``lowrank`` when enabled and the
        bucket has a matrix to factor, at any density: charged by its measured quality, it stands for dense
        where dense costs more than the steps it saves.  An unusable one costs inf."""
        if exchange in SPARSE:
            return density < 1.0
        if exchange == LOW_RANK:
            return self.lowrank and bucket in self.factor_sizes
        if exchange == "dense16":
            return self.dense16 and value_bytes > HALF_BYTES
        return True

    def _block_for(self, bucket: int, exchange: str, numel: int) -> float:
        """The bucket's measured local work of ``exchange``, else the slowest per-element rate measured on another
        bucket by an exchange of its kind (any sparse one for a sparse exchange) times ``numel``, else 0
        (optimistic: it gets tried).  Without the scaled rate every bucket's first low-rank trial was rated at
        its collectives alone: 1-8 ms predicted against 40-80 ms of factoring per 6.25M-float bucket
        (``benchmarks/flex_step.py``), tried again on each bucket."""
        own = self._block.get((bucket, exchange))
        if own is not None:
            return own
        kin = SPARSE if exchange in SPARSE else (exchange,)
        rates = [t / self.sizes[b][0] for (b, e), t in sorted(self._block.items())
                 if e in kin and b in self.sizes and self.sizes[b][0] > 0]
        return max(rates) * numel if rates else 0.0

    def set_sizes(self, sizes: dict[int, tuple[int, int]]) -> None:
        """The buckets of the current layout (as agreed): bucket -> (numel, value bytes)."""
        self._costs.clear()
        self.sizes = dict(sizes)

    def note_sizes(self, bucket: int, numel: int, value_bytes: int, factor_size: tuple[int, int] | None) -> None:
        """What the model needs of a bucket: its elements, their bytes, its low-rank payload (None: none).
        A bucket index whose size changed is another bucket (DDP rebuilds its buckets after the first
        step): what was measured under the index is dropped."""
        if self.sizes.get(bucket, (numel, value_bytes)) != (numel, value_bytes):
            self.forget({bucket})
        if self.sizes.get(bucket) == (numel, value_bytes) and self.factor_sizes.get(bucket) == factor_size:
            return
        self._costs.clear()
        self.sizes[bucket] = (numel, value_bytes)
        if factor_size is None:
            self.factor_sizes.pop(bucket, None)
        else:
            self.factor_sizes[bucket] = factor_size

    def forget(self, buckets: set[int]) -> None:
        """Drop all that was measured for ``buckets``."""
        self._costs.clear()
        for table in (self.sizes, self.factor_sizes, self._gap):
            for bucket in buckets & set(table):
                del table[bucket]
        for pairs_table in (self._block, self.measured_step, self._factor, self._quality):
            drop_buckets(pairs_table, buckets)
        self.calibration.forget(buckets)

    def state_dict(self) -> dict[str, Any]:
        return {"estimator": self.estimator.state_dict(), "sizes": {b: list(s) for b, s in self.sizes.items()},
                "block": pairs(self._block), **self.calibration.state_dict(), "gap": dict(self._gap),
                "measured_at": pairs(self.measured_step), "factor": pairs(self._factor), "quality": pairs(self._quality),
                "factor_sizes": {b: list(s) for b, s in self.factor_sizes.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; keys absent from older checkpoints load empty."""
        self._costs.clear()
        self.estimator.load_state_dict(state["estimator"])
        self.params = self.estimator.params  # the parameters the saved calibrations are relative to
        self.sizes = {int(b): (int(n), int(v)) for b, (n, v) in state["sizes"].items()}
        self._block = unpairs(state["block"])
        self.calibration.load_state_dict(state)
        self._gap = {int(b): float(g) for b, g in state["gap"].items()}
        self.measured_step = unpairs(state["measured_at"])
        self._factor = {key: float(v) for key, v in unpairs(state.get("factor", [])).items()}
        self._quality = {key: float(v) for key, v in unpairs(state.get("quality", [])).items()}
        self.factor_sizes = {int(b): (int(p), int(q)) for b, (p, q) in state.get("factor_sizes", {}).items()}
