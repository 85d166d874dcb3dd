"""The online fit of one collective kind's ``alpha`` and ``beta`` from timed collectives.

Model.  A collective of ``m`` bytes on ``N`` ranks takes ``t = a(N) alpha + b(N, m) beta``
with the coefficients of :func:`flexcomm.cost.model.collective_coefficients`, so one
estimator learns from samples of any size and any ``N``.

Scaling.  ``alpha`` (~1e-4 s) and ``beta`` (~1e-9 s/byte) differ by five orders of magnitude
and timing noise is roughly proportional to the time, so each sample is rewritten in units
of the prior ``(alpha0, beta0)``: with ``A = a alpha0``, ``B = b beta0``, ``s = A + B``,
``u = alpha / alpha0`` and ``v = beta / beta0``,

    y = t / s = x_u u + x_v v,    x = (A / s, B / s),  x_u + x_v = 1.

Least squares on these rows minimises the *relative* error of the predictions, and the
features stay in [0, 1] whatever the message size.

Forgetting.  With factor ``lam`` the estimate after ``n`` samples minimises

    sum_i lam^(n-i) (y_i - x_i . theta)^2  +  p_n ||theta - (1, 1)||^2,   theta = (u, v) >= f (1, 1),

i.e. recursive least squares with exponential forgetting.  The sums ``S = sum w x x^T`` and
``r = sum w x y`` are kept (5 floats); each sample multiplies them by ``lam`` and adds its
own term, so a sample's weight halves every ``ln 2 / -ln lam`` samples (23 at 0.97).
The prior term ``p_n = max(lam^n p_0, p_floor)`` (the prior is worth ``p_0`` samples at the
start) settles ``theta`` before any sample exists, fades like the data, and its tiny floor keeps
the 2x2 system solvable when only one message size is ever observed.  ``p_0`` is
:data:`PRIOR_WEIGHT`, a hundredth of a sample.  The prior is a ridge towards ``(1, 1)``, i.e.
1 Gbit/s, and a slow link sits far from it (``v`` ~ 10 at 100 Mbit/s): worth a whole sample it
pulled the start-up probe's fit there to about half the dense allreduce's time
(``benchmarks/probe_cost.py --rounds 8``, median error of the MLP's dense allreduce predicted from
one probe: 5% / 50% / 49% at 1 Gbit/s / 100 / 20 Mbit/s; 14% / 19% / 9% at a hundredth).

Floor.  Neither parameter falls below :data:`FLOOR` times the prior's (``f`` above; 0.1 us and
1 Tbit/s).  So weak a prior lets a noisy probe on a fast link fit ``beta = 0`` (bytes free):
``flex`` on loopback then rated dense16 no cheaper than dense, in 2 of 12 runs of
``test_flex_dense16_is_the_fp16_average_widened`` before the floor.  A floor far below any
link keeps the order of sizes (more bytes never cost less) without pulling a fit anywhere.
The per-pair calibration of measured over modelled times corrects the chooser's times once
pairs run.

One message size.  Samples of a single size pin only ``x . theta = y``: any point of that
line fits them, and the faces of the constraint (``alpha`` or ``beta`` at its floor) fit them
as well as any other -- an estimate that collapses to the ``beta`` floor then predicts a 100x
larger message to cost about the same.  So when the weighted samples do not tell the two parameters apart
(the smaller eigenvalue of ``S`` under ``IDENTIFIED_RATIO`` times the larger one), a ridge
``q ||P theta||^2`` pulls ``theta`` towards the prior's direction ``(1, 1)``
(``P = I - (1, 1)(1, 1)^T / 2``): one size scales ``alpha`` and ``beta`` by the same factor
instead of flooring one.  ``q = PERPENDICULAR_RIDGE * trace(S) * (1 - ratio / IDENTIFIED_RATIO)``
fades to 0 as a second size makes the fit well posed, so it never biases an identified fit.

Constraint.  ``theta >= f (1, 1)`` is solved exactly (with ``theta = f (1, 1) + phi``, a
two-variable non-negative least squares in ``phi``: the unconstrained solution if feasible,
else the better of the two one-variable fits on the faces ``phi_u = 0`` and ``phi_v = 0``), not
by clipping.
"""

from __future__ import annotations

import math
from typing import Any

from flexcomm.cost.model import GLOO_ALGORITHMS, CollectiveKind, LinkParams, collective_coefficients, validate_algorithm

#: Prior before any sample: alpha = 100 us (a 1-float gloo allreduce between two ranks
#: takes 0.2-0.4 ms here, i.e. two latency terms) and 1 Gbit/s.
DEFAULT_PRIOR = LinkParams.from_bandwidth(1e-4, 1e9)
STATE_VERSION = 1
#: The prior's worth in samples at the start (see the module docstring).
PRIOR_WEIGHT = 0.01
#: Neither alpha nor beta is fitted below this fraction of the prior's (see "Floor").
FLOOR = 1e-3
#: Below this ratio of the sample matrix's eigenvalues (smaller / larger) the samples are
#: treated as one message size.  Measured on the prior's scale: two sizes 2x apart give
#: ~4e-3, sizes spread over 128 KiB-64 MiB ~1.3e-3; one size after probes at two sizes
#: falls below 1e-3 once the probes' weight has faded to ~1% (40 samples at forgetting 0.9).
IDENTIFIED_RATIO = 1e-3
#: Weight of the pull towards the prior's direction, relative to the samples' total weight.
PERPENDICULAR_RIDGE = 1e-2
#: A sample is bandwidth-bound when the fit's latency term is at most 1 minus this share of its predicted or measured time.
BANDWIDTH_BOUND = 0.8


class AlphaBetaEstimator:
    """Exponentially forgetting, non-negative least-squares fit of ``(alpha, beta)`` for one kind.

    Args:
        kind: ``"allreduce"``, ``"allgather"`` or ``"broadcast"``.
        forgetting: factor ``lam`` in (0, 1]; 1 keeps every sample forever.
        algorithm: the algorithm whose coefficients apply; default gloo's (:data:`GLOO_ALGORITHMS`).
        prior: ``(alpha0, beta0)``, both > 0; also the scale of the normalised fit.
        prior_weight: the prior's worth in samples at the start.
        prior_floor: the prior's weight never decays below this.
    """

    def __init__(
        self,
        kind: CollectiveKind,
        forgetting: float = 0.97,
        algorithm: str | None = None,
        prior: LinkParams = DEFAULT_PRIOR,
        prior_weight: float = PRIOR_WEIGHT,
        prior_floor: float = 1e-9,
    ) -> None:
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        if not (prior.alpha > 0.0 and prior.beta > 0.0):
            raise ValueError("prior alpha and beta must be > 0 (they set the fit's scale)")
        if not 0.0 < prior_floor <= prior_weight:
            raise ValueError("need 0 < prior_floor <= prior_weight")
        self.kind = kind
        self.algorithm = algorithm if algorithm is not None else GLOO_ALGORITHMS.of(kind)
        validate_algorithm(kind, self.algorithm)
        self.forgetting = forgetting
        self.prior = prior
        self.prior_floor = prior_floor
        self._prior_weight = prior_weight
        self._s = [0.0, 0.0, 0.0]  # S_uu, S_uv, S_vv
        self._r = [0.0, 0.0]  # r_u, r_v
        self.count = 0

    def observe(self, nbytes: int, world_size: int, seconds: float) -> None:
        """Add one timed collective.  ``world_size == 1`` carries no information and is ignored."""
        if not (math.isfinite(seconds) and seconds >= 0.0):
            raise ValueError(f"seconds must be finite and >= 0, got {seconds}")
        a, b = collective_coefficients(self.kind, self.algorithm, nbytes, world_size)
        scale = a * self.prior.alpha + b * self.prior.beta
        if scale == 0.0:
            return
        xu = a * self.prior.alpha / scale
        xv = b * self.prior.beta / scale
        y = seconds / scale
        lam = self.forgetting
        s, r = self._s, self._r
        s[0] = lam * s[0] + xu * xu
        s[1] = lam * s[1] + xu * xv
        s[2] = lam * s[2] + xv * xv
        r[0] = lam * r[0] + xu * y
        r[1] = lam * r[1] + xv * y
        self._prior_weight = max(lam * self._prior_weight, self.prior_floor)
        self.count += 1

    @property
    def params(self) -> LinkParams:
        """Current estimate of ``(alpha, beta)``, each at least ``FLOOR`` times the prior's."""
        u, v = self._solve()
        return LinkParams(u * self.prior.alpha, v * self.prior.beta)

    def predict(self, nbytes: int, world_size: int) -> float:
        """Predicted seconds of one collective under the current estimate."""
        a, b = collective_coefficients(self.kind, self.algorithm, nbytes, world_size)
        link = self.params
        return a * link.alpha + b * link.beta

    def beta_ratio(self, nbytes: int, world_size: int, seconds: float) -> float | None:
        """The factor on ``beta`` that would make the fit predict ``seconds`` for this collective, when it is
        bandwidth-bound: the fit's latency term at most ``1 - BANDWIDTH_BOUND`` of the predicted or of the
        measured time (a link that slowed down makes a message bandwidth-bound that was not); else None."""
        a, b = collective_coefficients(self.kind, self.algorithm, nbytes, world_size)
        link = self.params
        latency, bandwidth = a * link.alpha, b * link.beta
        if bandwidth <= 0.0 or latency > (1.0 - BANDWIDTH_BOUND) * max(seconds, latency + bandwidth):
            return None
        return max(0.0, seconds - latency) / bandwidth

    def shift_beta(self, factor: float) -> None:
        """Move the fit to ``(alpha, factor * beta)``, keeping the samples' weights (see "Regime shifts")."""
        if not (math.isfinite(factor) and factor > 0.0):
            raise ValueError(f"factor must be finite and > 0, got {factor}")
        u, v = self._solve()
        v *= factor
        muu, muv, mvv, p = self._system()
        self._r = [muu * u + muv * v - p, muv * u + mvv * v - p]

    def _system(self) -> tuple[float, float, float, float]:
        """``M``'s entries (uu, uv, vv) and the prior's weight ``p``: the fit minimises
        ``theta^T M theta - 2 (r + p (1, 1))^T theta``."""
        p = self._prior_weight
        q = self._perpendicular_ridge()
        # M = S + p I + q P with P = [[1/2, -1/2], [-1/2, 1/2]] (P (1, 1) = 0).
        return self._s[0] + p + 0.5 * q, self._s[1] - 0.5 * q, self._s[2] + p + 0.5 * q, p

    def _solve(self) -> tuple[float, float]:
        """Minimise ``theta^T M theta - 2 c^T theta`` over ``theta >= FLOOR (1, 1)`` (``M`` is positive
        definite), as a non-negative least squares in ``phi = theta - FLOOR (1, 1)``."""
        muu, muv, mvv, p = self._system()
        cu = self._r[0] + p - FLOOR * (muu + muv)
        cv = self._r[1] + p - FLOOR * (muv + mvv)
        det = muu * mvv - muv * muv
        u = (mvv * cu - muv * cv) / det
        v = (muu * cv - muv * cu) / det
        if not (u >= 0.0 and v >= 0.0):
            on_v0 = (max(0.0, cu / muu), 0.0)
            on_u0 = (0.0, max(0.0, cv / mvv))

            def objective(phi: tuple[float, float]) -> float:
                fu, fv = phi
                return muu * fu * fu + 2.0 * muv * fu * fv + mvv * fv * fv - 2.0 * (cu * fu + cv * fv)

            u, v = on_v0 if objective(on_v0) <= objective(on_u0) else on_u0
        return FLOOR + u, FLOOR + v

    def _perpendicular_ridge(self) -> float:
        """``q`` of the module docstring: > 0 only while the samples look like one message size."""
        suu, suv, svv = self._s
        trace = suu + svv
        if trace <= 0.0:
            return 0.0
        # Eigenvalues of the 2x2 S: their product is det, their sum the trace.
        det = max(0.0, suu * svv - suv * suv)
        root = math.sqrt(max(0.0, trace * trace - 4.0 * det))
        smaller, larger = 0.5 * (trace - root), 0.5 * (trace + root)
        ratio = smaller / larger
        if ratio >= IDENTIFIED_RATIO:
            return 0.0
        return PERPENDICULAR_RIDGE * trace * (1.0 - ratio / IDENTIFIED_RATIO)

    def state_dict(self) -> dict[str, Any]:
        """Plain, picklable state (floats, ints, strings, lists) for checkpoints."""
        return {
            "version": STATE_VERSION,
            "kind": self.kind,
            "algorithm": self.algorithm,
            "forgetting": self.forgetting,
            "prior": [self.prior.alpha, self.prior.beta],
            "prior_floor": self.prior_floor,
            "prior_weight": self._prior_weight,
            "s": list(self._s),
            "r": list(self._r),
            "count": self.count,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict`; afterwards predictions are bitwise identical."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"unsupported estimator state version {state.get('version')!r}")
        if state["kind"] != self.kind:
            raise ValueError(f"state is for {state['kind']!r}, this estimator is for {self.kind!r}")
        validate_algorithm(self.kind, state["algorithm"])
        self.algorithm = state["algorithm"]
        self.forgetting = float(state["forgetting"])
        self.prior = LinkParams(*(float(x) for x in state["prior"]))
        self.prior_floor = float(state["prior_floor"])
        self._prior_weight = float(state["prior_weight"])
        self._s = [float(x) for x in state["s"]]
        self._r = [float(x) for x in state["r"]]
        self.count = int(state["count"])
