"""Per-step metrics of the hook for the user's own loggers, as one flat dict of numbers.

Every value is this rank's own record of the step or a value every rank agreed on: building
the dict issues no collective.  The integrations send rank 0's dict
(:class:`flexcomm.lightning.FlexCommStrategy`, :func:`flexcomm.accelerate.register` with
``log_every``); a plain script calls :meth:`flexcomm.FlexState.metrics`, or
:func:`write_scalars` to send them to a TensorBoard ``SummaryWriter``.

Keys of the newest step (from its :class:`~flexcomm.BucketRecord` list; present once a step ran):

``flexcomm/step``                       the hook's step counter of that step (0-based).
``flexcomm/density``                    fraction of its elements each compressed bucket sent (the
                                        configured density, or the controller's); 1.0 when every
                                        bucket went dense (warm-up, ``dense``, or ``flex`` chose dense
                                        or dense16).
``flexcomm/sent_fraction``              gradient elements sent / gradient elements, dense buckets
                                        counted whole (k is at least 1 per bucket).
``flexcomm/share_dense``,               fraction of the step's buckets exchanged by dense allreduce,
``flexcomm/share_dense16``,             dense allreduce in fp16 (``flex``), AG-Topk (allgather;
``flexcomm/share_agtopk``,              ``mstopk`` too), AR-Topk and low-rank factors; they sum to 1.
``flexcomm/share_artopk``,
``flexcomm/share_lowrank``
``flexcomm/share_explored``             fraction of the step's buckets whose exchange was ``flex``
                                        trying an alternative (exploration), not its plan's choice.
``flexcomm/bytes_sent``                 bytes this rank handed to the step's collectives (payload,
                                        not wire bytes).
``flexcomm/exchange_time_s``            seconds, measured: summed over buckets, local work of the
                                        exchange plus its collectives from the first launch to the
                                        last completion.  Exchanges overlap backward and each other,
                                        so this is not time added to the step; a collective queued
                                        behind an earlier bucket's counts its wait.
``flexcomm/predicted_exchange_time_s``  seconds, the cost model's time of the same exchanges (local
                                        work plus each collective's own time, without queueing);
                                        ``flex`` and ``density="auto"`` only.  The agreed
                                        (predicted, measured) pairs without queueing are in
                                        ``state.planner.prediction_log``.
``flexcomm/quality``                    ``cos(update, mean gradient)`` on the shared sample, mean over
                                        the step's buckets that measured it (``flex``'s low-rank
                                        exchanges; agreed on every rank); absent where none did.

Keys of the decisions (agreed on every rank; present once there is one):

``flexcomm/flex/dense_step_s``          seconds, ``flex``'s guard: the measured period of whole
``flexcomm/flex/plan_step_s``           steps exchanged all dense (dense16 where ``flex`` may send
                                        it on every bucket, else fp32), and of steps that ran the
                                        plan.  The plan is all-dense whenever the first is clearly smaller.
``flexcomm/auto/decision_step``         ``density="auto"``: the step of the controller's last decision;
``flexcomm/auto/gain``                  the chosen density's agreed compression gain
                                        ``||sent part of a|| / ||a||``;
``flexcomm/auto/predicted_step_s``      seconds, its predicted step time;
``flexcomm/auto/densest_step_s``        seconds, the densest candidate's (dense's, by default)
                                        predicted step time: what the choice saves;
``flexcomm/auto/floor``                 the ramp's floor then: the sparsest density allowed.
                                        :func:`decision_reason` says the same in one line.

Time hidden behind backward is not among them: the records hold durations, not when
backward ended or when each bucket was handed over, so it cannot be derived from them
(``flexcomm-train``'s ``t_wait`` measures the part of backward held up, by timing the hook).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from flexcomm.exchange import DENSE_EXCHANGES
from flexcomm.exchange import EXCHANGES as EXCHANGE_FUNCTIONS
from flexcomm.exchange.job import BucketRecord

if TYPE_CHECKING:
    from flexcomm.control import DensityController, ExchangeChooser
    from flexcomm.state import FlexState

PREFIX = "flexcomm/"
#: The exchanges a bucket can use, as the records name them.
EXCHANGES = tuple(EXCHANGE_FUNCTIONS)


def metrics(state: FlexState, records: Sequence[BucketRecord] | None = None) -> dict[str, float]:
    """One step's metrics and the decision metrics of ``state`` (see the module docstring).

    ``records``: one step's records an app has drained already; by default the newest step
    of those ``state`` still holds, read without draining them.  Settles the finished step
    first (a local device-to-host read, no collective; on a GPU the exchanges' times are
    read there).
    """
    state.settle()
    return {
        **step_metrics(newest_step(state.records) if records is None else records),
        **flex_metrics(state.chooser),
        **auto_metrics(state.controller),
    }


class ScalarWriter(Protocol):
    """What :func:`write_scalars` needs: ``torch.utils.tensorboard.SummaryWriter`` (or tensorboardX's) has it."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> Any: ...


def write_scalars(writer: ScalarWriter, state: FlexState, global_step: int | None = None) -> dict[str, float]:
    """Write :func:`metrics` of ``state`` to ``writer``, one scalar per key; returns what was written.

    ``global_step`` defaults to the hook's step of the newest records (``flexcomm/step``).
    Call it on one rank (rank 0) every few steps, as a script calls ``add_scalar``.
    """
    values = metrics(state)
    step = global_step if global_step is not None else values.get(PREFIX + "step")
    for tag, value in values.items():
        writer.add_scalar(tag, value, None if step is None else int(step))
    return values


def newest_step(records: Sequence[BucketRecord]) -> list[BucketRecord]:
    """The records at the end of ``records`` that share the last record's step, in order.

    Reads from the end only, so a long deque of undrained records costs one step's worth.
    """
    newest: list[BucketRecord] = []
    for record in reversed(records):
        if newest and record.step != newest[-1].step:
            break
        newest.append(record)
    return newest[::-1]


def step_metrics(records: Sequence[BucketRecord]) -> dict[str, float]:
    """The step keys of one step's records (``{}`` for none)."""
    if not records:
        return {}
    numel = sum(r.numel for r in records)
    compressed = [r.density for r in records if r.exchange not in DENSE_EXCHANGES]
    values: dict[str, float] = {
        "step": records[-1].step,
        "density": max(compressed) if compressed else 1.0,
        "sent_fraction": sum(r.k for r in records) / numel if numel else 1.0,
        **{f"share_{e}": sum(r.exchange == e for r in records) / len(records) for e in EXCHANGES},
        "share_explored": sum(r.explored for r in records) / len(records),
        "bytes_sent": sum(r.bytes_sent for r in records),
        "exchange_time_s": sum(r.t_compress + r.t_exchange for r in records),
    }
    predicted = [r.predicted for r in records]
    if all(math.isfinite(p) for p in predicted):
        values["predicted_exchange_time_s"] = sum(predicted)
    qualities = [r.quality for r in records if math.isfinite(r.quality)]
    if qualities:
        values["quality"] = sum(qualities) / len(qualities)
    return _prefixed(values)


def flex_metrics(chooser: ExchangeChooser) -> dict[str, float]:
    """The guard's measured whole-step periods (``{}`` before ``flex`` measured any)."""
    names = {"dense": "flex/dense_step_s", "other": "flex/plan_step_s"}
    return _prefixed({names[kind]: seconds for kind, (seconds, _) in chooser.measured_steps.items() if kind in names})


def auto_metrics(controller: DensityController | None) -> dict[str, float]:
    """The density controller's last decision (``{}`` without ``density="auto"`` or before its first)."""
    decision = last_decision(controller)
    if decision is None:
        return {}
    chosen = _chosen(decision)
    return _prefixed({
        "auto/decision_step": decision["step"],
        "auto/gain": chosen["gain"],
        "auto/predicted_step_s": chosen["seconds"],
        "auto/densest_step_s": decision["candidates"][0]["seconds"],
        "auto/floor": decision["floor"],
    })


def last_decision(controller: DensityController | None) -> dict[str, Any] | None:
    """The controller's newest decision record (see ``DensityController.decisions``), or ``None``."""
    return controller.decisions[-1] if controller is not None and controller.decisions else None


def decision_reason(controller: DensityController | None) -> str | None:
    """The controller's last decision and why, in one line (``None`` before its first).

    For example ``"step 300: density 0.011 by rule goodput (gain 0.62, predicted step 41.0 ms;
    density 1 predicted 120.0 ms); front 1, 0.1, 0.033, 0.011; ramp floor 0.011"``.
    """
    decision = last_decision(controller)
    if decision is None:
        return None
    chosen, densest = _chosen(decision), decision["candidates"][0]
    front = ", ".join(f"{d:g}" for d in decision["front"])
    return (
        f"step {decision['step']}: density {chosen['density']:g} by rule {controller.rule} "
        f"(gain {chosen['gain']:.2f}, predicted step {chosen['seconds'] * 1e3:.1f} ms; "
        f"density {densest['density']:g} predicted {densest['seconds'] * 1e3:.1f} ms); "
        f"front {front}; ramp floor {decision['floor']:g}"
    )


def _chosen(decision: dict[str, Any]) -> dict[str, Any]:
    """The candidate entry of the decision's chosen density."""
    return next(c for c in decision["candidates"] if c["density"] == decision["density"])


def _prefixed(values: dict[str, float]) -> dict[str, float]:
    return {PREFIX + key: value for key, value in values.items()}
