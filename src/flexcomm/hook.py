"""The DDP communication hook: flexcomm's public entry point.

Usage, like PyTorch's PowerSGD hook::

    state = flexcomm.FlexState(process_group=None, compressor="artopk-star", density=0.01)
    ddp_model.register_comm_hook(state, flexcomm.hook)

or ``state = flexcomm.register(ddp_model, compressor="artopk-star", density=0.01)``, which
also names the parameters so that residuals survive bucket rebuilds and restarts.

For every DDP bucket (N ranks, M elements, k = max(1, ceil(density * M))) rank i forms
the error-corrected gradient ``a_i = g_i + e_i`` and exchanges part of it:

``dense``        allreduce ``a_i``; the update is ``sum_i a_i / N``; no residual.
``agtopk``       rank i sends its own top-k ``(values, indices)`` of ``|a_i|`` in one
                 allgather; the update is the sum of the N sparse vectors over N.
``mstopk``       as ``agtopk``, but the k indices come from MSTopk's multi-round
                 threshold search instead of an exact top-k.
``artopk-star``  one index-source rank r picks the top-k indices I of ``|a_r|`` and
                 broadcasts them; every rank allreduces ``a_i[I]``; the update is
                 ``sum_i a_i[I] / N`` at I, zero elsewhere.  r = step mod N.
``artopk-var``   as ``artopk-star``, with r = the rank whose EWMA of a gradient statistic
                 (L2 norm of ``a_i`` by default, or its variance) is largest, ties to the
                 lowest rank.  Each rank's statistic rides along in the values' allreduce
                 (N extra slots), so every rank holds the same EWMAs and picks the same r
                 at the next step with no extra collective.
``flex``         per bucket, whichever of dense, agtopk and artopk-star the alpha-beta
                 model (plus measured compression time) predicts cheapest now; see
                 :mod:`flexcomm.control.exchange`.  (alpha, beta) are estimated online:
                 a probe of a few message sizes at start and every ``probe_every`` steps,
                 and the exchanges' own timings, agreed across ranks every
                 ``flex_interval`` steps.  Decisions change only at those agreement points,
                 from inputs every rank holds identically, so all ranks pick the same.

``density="auto"`` lets a :class:`~flexcomm.control.DensityController` move the density
along the Pareto front of compression gain and step time (see :mod:`flexcomm.control.density`);
every ``measure_every`` steps each bucket's gain curve over the candidates is computed from
one top-k pass, summed over buckets and ranks by one allreduce, and all ranks decide alike.

Error feedback: the new residual is ``e_i = a_i`` with the sent indices zeroed, so what
rank i contributed plus its residual equals ``a_i``.  A non-finite ``a_i`` on any rank
turns the exchanged values into NaN on every rank (so ``torch.amp.GradScaler`` sees it and
skips the step) and every rank keeps its previous residual.
"""


import math
from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from flexcomm.comm import agree_on_config, agree_on_times, allgather, allreduce_sum, broadcast_from, probe_collectives
from flexcomm.compress import ResidualMemory, TopkWorkspace, k_for, mstopk_indices, pack, topk_indices, unpack_all
from flexcomm.compress.memory import Layout
from flexcomm.compress.mstopk import DEFAULT_ROUNDS
from flexcomm.compress.gain import kept_energy, total_energy
from flexcomm.control import DensityController, ExchangeChooser
from flexcomm.cost import CostEstimator, Observation
from flexcomm.version import __version__

COMPRESSORS = ("dense", "agtopk", "mstopk", "artopk-star", "artopk-var", "flex")
VAR_STATISTICS = ("norm", "variance")
_STATE_FORMAT = 1


@dataclass
class BucketRecord:
    """What one bucket's exchange did at one step.

    ``bytes_sent`` is the payload of the collectives this rank took part in (what the
    backend was handed), not wire bytes, which depend on the collective's algorithm.
    ``t_compress`` is all local work of the compressed exchange (selection, gathering the
    values, residual update, writing the result back); ``t_exchange`` runs from the first
    collective's launch to the last one's completion.
    ``gain`` is this rank's ``||sent part of a_i|| / ||a_i||``.  ``predicted`` is the
    cost model's time for the chosen exchange (``flex`` only, else NaN).
    """

    step: int
    bucket: int
    numel: int
    exchange: str
    k: int
    leader: int
    t_compress: float
    t_exchange: float
    bytes_sent: int
    gain: float
    finite: bool = True
    predicted: float = math.nan
    density: float = math.nan

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class FlexState:
    """Everything the hook keeps between calls: configuration, residuals, counters, records.

    Args:
        process_group: the group to communicate over (``None``: the default group).
        compressor: one of :data:`COMPRESSORS`.
        density: fraction of each bucket's elements sent, in (0, 1], or ``"auto"``.
        controller: the :class:`DensityController` of ``density="auto"`` (default settings if None).
        warmup_steps: exchange dense for the first this many steps.
        mstopk_rounds: threshold-search rounds of ``mstopk``.
        var_statistic: ``artopk-var``'s statistic, ``"norm"`` (the authors') or ``"variance"``.
        var_smoothing: EWMA factor ``s <- smoothing * s + (1 - smoothing) * x``, in [0, 1).
        flex_interval: ``flex`` agrees on measured times and re-decides every this many steps.
        probe_every: ``flex`` re-probes the collectives every this many steps.
        probe_sizes: message sizes in bytes the probe times.  Keep them above a shaped link's
            burst (tbf lets a few hundred KB through faster than the rate).
        forgetting: the (alpha, beta) estimator's forgetting factor per sample, in (0, 1]:
            lower follows a changing network faster, higher averages out more noise.
        max_records: how many :class:`BucketRecord` are kept until :meth:`drain_records`.
    """

    def __init__(
        self,
        process_group: dist.ProcessGroup | None = None,
        compressor: str = "artopk-star",
        density: float | str = 0.01,
        controller: DensityController | None = None,
        warmup_steps: int = 0,
        mstopk_rounds: int = DEFAULT_ROUNDS,
        var_statistic: str = "norm",
        var_smoothing: float = 0.9,
        flex_interval: int = 10,
        probe_every: int = 200,
        probe_sizes: tuple[int, ...] = (65536, 1 << 20),
        forgetting: float = 0.9,
        max_records: int = 100_000,
    ) -> None:
        if compressor not in COMPRESSORS:
            raise ValueError(f"compressor must be one of {', '.join(COMPRESSORS)}; got {compressor!r}")
        if density == "auto":
            controller = controller or DensityController()
        else:
            _check_number("density", density)
            if not 0.0 < density <= 1.0:
                raise ValueError(f"density must be in (0, 1] or 'auto', got {density}")
            if controller is not None:
                raise ValueError("controller is only used with density='auto'")
        _check_int("warmup_steps", warmup_steps, minimum=0)
        _check_int("mstopk_rounds", mstopk_rounds, minimum=1)
        if var_statistic not in VAR_STATISTICS:
            raise ValueError(f"var_statistic must be one of {', '.join(VAR_STATISTICS)}; got {var_statistic!r}")
        _check_number("var_smoothing", var_smoothing)
        if not 0.0 <= var_smoothing < 1.0:
            raise ValueError(f"var_smoothing must be in [0, 1), got {var_smoothing}")
        _check_int("flex_interval", flex_interval, minimum=1)
        _check_int("probe_every", probe_every, minimum=1)
        if not probe_sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 4 for b in probe_sizes):
            raise ValueError(f"probe_sizes must be a non-empty sequence of ints >= 4 (bytes), got {probe_sizes!r}")
        _check_int("max_records", max_records, minimum=1)
        self.process_group = process_group
        self.compressor = compressor
        self.controller = controller
        self._fixed_density = None if controller else float(density)
        self.warmup_steps = warmup_steps
        self.mstopk_rounds = mstopk_rounds
        self.var_statistic = var_statistic
        self.var_smoothing = float(var_smoothing)
        self.flex_interval = flex_interval
        self.probe_every = probe_every
        self.probe_sizes = tuple(probe_sizes)
        _check_number("forgetting", forgetting)
        if not 0.0 < forgetting <= 1.0:
            raise ValueError(f"forgetting must be in (0, 1], got {forgetting}")
        self.forgetting = float(forgetting)
        self.chooser = ExchangeChooser(CostEstimator(forgetting=forgetting))
        self.step = 0
        self.memory = ResidualMemory()
        self.records: "deque[BucketRecord]" = deque(maxlen=max_records)
        self._var_ewma: dict[int, list[float]] = {}
        self._leader_counts: list[int] | None = None
        self._workspaces: dict[int, TopkWorkspace] = {}
        self._in_step = False
        self._config_checked = False
        self._param_names: dict[int, str] | None = None
        self._probed_at: int | None = None
        # Gain curve of this step (density="auto"): kept energy per candidate, then the total.
        self._measure_gain = False
        self._gain_energy: list[float] | None = None
        self._bucket_sizes: dict[int, tuple[int, int]] = {}
        # Filled by exchange callbacks, agreed across ranks at the next agreement point.
        self._measured_comm: list[tuple[tuple[int, int], Observation]] = []
        self._measured_compress: list[tuple[tuple[int, int], float]] = []

    @property
    def density(self) -> float:
        """The density in force now (the controller's choice under ``density="auto"``)."""
        return self.controller.density if self.controller else self._fixed_density

    @property
    def _estimating(self) -> bool:
        """Whether decisions need the online cost estimate (``flex`` or ``auto``)."""
        return self.compressor == "flex" or self.controller is not None

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    @property
    def leader_counts(self) -> list[int]:
        """How many bucket exchanges each rank was AR-Topk's index source for."""
        if self._leader_counts is None:
            self._leader_counts = [0] * self.world_size
        return self._leader_counts

    def drain_records(self) -> list[BucketRecord]:
        """Return and forget the records collected since the last call."""
        drained = list(self.records)
        self.records.clear()
        return drained

    def leader_for(self, bucket_index: int, step: int) -> int:
        """AR-Topk's index-source rank for a bucket at a step; the same on every rank."""
        if self.compressor != "artopk-var":
            return step % self.world_size
        ewma = self._var_ewma.get(bucket_index)
        if ewma is None:
            return 0
        return max(range(len(ewma)), key=lambda r: (ewma[r], -r))

    def state_dict(self) -> dict[str, Any]:
        """Residuals, counters and smoothed statistics, for a checkpoint."""
        return {
            "format": _STATE_FORMAT,
            "compressor": self.compressor,
            "density": self.density,
            "world_size": self.world_size,
            "step": self.step,
            "memory": self.memory.state_dict(),
            "var_ewma": {i: list(v) for i, v in self._var_ewma.items()},
            "leader_counts": list(self.leader_counts),
            "chooser": self.chooser.state_dict(),
            "probed_at": self._probed_at,
            "controller": self.controller.state_dict() if self.controller else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuses a checkpoint of another compressor or world size."""
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"unsupported FlexState checkpoint format {state.get('format')!r}")
        for key, mine in (("compressor", self.compressor), ("world_size", self.world_size)):
            if state[key] != mine:
                raise ValueError(f"checkpoint was written with {key}={state[key]!r}, this run has {key}={mine!r}")
        self.step = int(state["step"])
        self.memory.load_state_dict(state["memory"])
        self._var_ewma = {int(i): list(v) for i, v in state["var_ewma"].items()}
        self._leader_counts = list(state["leader_counts"])
        self.chooser.load_state_dict(state["chooser"])
        self._probed_at = state["probed_at"]
        if (state["controller"] is None) != (self.controller is None):
            raise ValueError("checkpoint and this run disagree on density='auto'")
        if self.controller:
            self.controller.load_state_dict(state["controller"])

    def bind_parameters(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """Name the model's parameters, so residuals are kept per parameter (see :func:`register`)."""
        if self.step:
            raise RuntimeError("bind_parameters must be called before the first step")
        self._param_names = {id(p): name for name, p in named_parameters}
        self.memory.named = True

    def _layout(self, bucket: dist.GradBucket) -> Layout:
        params = bucket.parameters()
        if self._param_names is None:
            return tuple((str(tuple(p.shape)), p.numel()) for p in params)
        return tuple((self._param_names[id(p)], p.numel()) for p in params)

    def fingerprint(self, first_bucket: torch.Tensor) -> dict[str, object]:
        """Everything that must be equal on all ranks for their exchanges to match."""
        controller = self.controller
        return {
            "flexcomm": __version__,
            "compressor": self.compressor,
            "density": "auto" if controller else self._fixed_density,
            "controller": (controller.candidates, controller.rule, controller.time_weight, controller.measure_every,
                           controller.warmup_steps, controller.ramp_steps) if controller else None,
            "warmup_steps": self.warmup_steps,
            "mstopk_rounds": self.mstopk_rounds,
            "var": (self.var_statistic, self.var_smoothing),
            "flex": (self.flex_interval, self.probe_every, self.probe_sizes, self.forgetting),
            "first_bucket": (first_bucket.numel(), str(first_bucket.dtype)),
        }

    def _begin_step(self, step: int) -> None:
        """Work at a step's first bucket, when no exchange is in flight: the agreement points."""
        if not self._estimating:
            return
        if self._probed_at is None or step - self._probed_at >= self.probe_every:
            self.chooser.estimator.observe_all(probe_collectives(self.probe_sizes, self.process_group))
            self._probed_at = step
            self.chooser.refresh()
        elif step % self.flex_interval == 0 and (self._measured_comm or self._measured_compress):
            self._agree_on_measurements()
            self.chooser.refresh()
        if self.controller:
            if self._gain_energy is not None:
                self._decide_density(step)
            self._measure_gain = self.controller.measure_at(step)

    def _accumulate_gain(self, bucket_index: int, accumulated: torch.Tensor) -> None:
        candidates = self.controller.candidates
        energy = kept_energy(accumulated, candidates, self._workspace(bucket_index)) + [total_energy(accumulated)]
        self._gain_energy = energy if self._gain_energy is None else [a + b for a, b in zip(self._gain_energy, energy)]
        self._bucket_sizes[bucket_index] = (accumulated.numel(), accumulated.element_size())

    def _decide_density(self, step: int) -> None:
        """Agree on the gain curve (sum over ranks), predict each candidate's time, let the controller pick."""
        energy = agree_on_times(self._gain_energy, self.process_group, dist.ReduceOp.SUM)
        self._gain_energy = None
        *kept, total = energy
        if not all(math.isfinite(e) for e in energy) or total <= 0.0:
            return  # a non-finite or all-zero step says nothing about the trade-off
        exchange = None if self.compressor == "flex" else _exchange_for_compressor(self.compressor)
        seconds = [
            sum(self.chooser.predicted_seconds(i, numel, c, self.world_size, vb, exchange) for i, (numel, vb) in self._bucket_sizes.items())
            for c in self.controller.candidates
        ]
        self.controller.update(step, [math.sqrt(k / total) for k in kept], seconds)

    def _agree_on_measurements(self) -> None:
        """Feed every rank the same timings: min over ranks for collectives, max for compression.

        One allreduce(MAX) carries both: the collectives' times negated (-max(-t) = min t).
        """
        comm = sorted(self._measured_comm, key=lambda item: item[0])
        compress = sorted(self._measured_compress, key=lambda item: item[0])
        self._measured_comm, self._measured_compress = [], []
        agreed = agree_on_times([-obs.seconds for _, obs in comm] + [t for _, t in compress], self.process_group, dist.ReduceOp.MAX)
        self.chooser.estimator.observe_all(obs._replace(seconds=-t) for (_, obs), t in zip(comm, agreed))
        for ((_, bucket), _), t in zip(compress, agreed[len(comm):]):
            self.chooser.observe_compression(bucket, t)

    def _workspace(self, bucket_index: int) -> TopkWorkspace:
        return self._workspaces.setdefault(bucket_index, TopkWorkspace())

    def _record_var_statistics(self, bucket_index: int, statistics: list[float]) -> None:
        previous = self._var_ewma.get(bucket_index)
        if previous is None:
            self._var_ewma[bucket_index] = statistics
            return
        s = self.var_smoothing
        self._var_ewma[bucket_index] = [s * p + (1.0 - s) * x for p, x in zip(previous, statistics)]


@dataclass
class _BucketContext:
    state: FlexState
    index: int
    layout: Layout
    step: int
    predicted: float = math.nan

    def record(self, **fields: Any) -> BucketRecord:
        rec = BucketRecord(step=self.step, bucket=self.index, predicted=self.predicted, density=self.state.density, **fields)
        self.state.records.append(rec)
        return rec

    def measured(self, rec: BucketRecord, kind: str, nbytes: int, seconds: float) -> None:
        """Keep a finished exchange's network sample and local compression work for the estimator."""
        if not self.state._estimating:
            return
        key = (self.step, self.index)
        self.state._measured_comm.append((key, Observation(kind, nbytes, self.state.world_size, seconds)))
        if rec.exchange != "dense":
            self.state._measured_compress.append((key, rec.t_compress))


def register(ddp_model: DistributedDataParallel, state: FlexState | None = None, **state_args: Any) -> FlexState:
    """Register :func:`hook` on ``ddp_model`` with its parameter names; return the state.

    Equivalent to ``ddp_model.register_comm_hook(state, hook)``, plus names: residuals are
    then kept per parameter, so they survive DDP's bucket rebuild and checkpoints restore
    them under any bucket layout.  Pass a ``state`` or the arguments of :class:`FlexState`.
    """
    if state is None:
        state = FlexState(process_group=ddp_model.process_group, **state_args)
    elif state_args:
        raise TypeError("pass either a FlexState or FlexState arguments, not both")
    state.bind_parameters(ddp_model.module.named_parameters())
    ddp_model.register_comm_hook(state, hook)
    return state


def hook(state: FlexState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: exchange one bucket as ``state.compressor`` says.

    Returns a future holding the bucket's averaged (sparse or dense) update.
    """
    grad = bucket.buffer()
    if not grad.is_floating_point():
        raise TypeError(f"flexcomm.hook needs floating-point gradients, got dtype {grad.dtype}")
    step = state.step
    if state.world_size == 1:
        _end_bucket(state, bucket)
        return _completed(grad)
    if not state._config_checked:
        agree_on_config(state.fingerprint(grad), state.process_group)
        state._config_checked = True
    if not state._in_step:
        state._begin_step(step)
        state._in_step = True
    _end_bucket(state, bucket)
    ctx = _BucketContext(
        state=state,
        index=bucket.index(),
        layout=state._layout(bucket),
        step=step,
    )
    accumulated = state.memory.compensate(ctx.index, ctx.layout, grad)
    if state._measure_gain:
        state._accumulate_gain(ctx.index, accumulated)
    # Under density="auto", density 1.0 means dense: sending every index would only add bytes.
    dense = step < state.warmup_steps or (state.controller is not None and state.density >= 1.0)
    exchange = "dense" if dense else _exchange_for(ctx, accumulated)
    if exchange == "dense":
        return _exchange_dense(ctx, accumulated)
    k = k_for(accumulated.numel(), state.density)
    if exchange == "agtopk":
        return _exchange_allgather(ctx, accumulated, k)
    return _exchange_artopk(ctx, accumulated, k)


def _exchange_for_compressor(compressor: str) -> str:
    return {"mstopk": "agtopk", "artopk-star": "artopk", "artopk-var": "artopk"}.get(compressor, compressor)


def _end_bucket(state: FlexState, bucket: dist.GradBucket) -> None:
    if bucket.is_last():
        state.step += 1
        state._in_step = False


def _exchange_for(ctx: _BucketContext, accumulated: torch.Tensor) -> str:
    """The exchange pattern: fixed by the compressor, or chosen by ``flex``."""
    state = ctx.state
    if state.compressor != "flex":
        return _exchange_for_compressor(state.compressor)
    choice = state.chooser.choose(ctx.index, accumulated.numel(), state.density, state.world_size, accumulated.element_size())
    state.chooser.keep(ctx.index, choice.exchange)
    ctx.predicted = choice.predicted[choice.exchange]
    return choice.exchange


def _exchange_dense(ctx: _BucketContext, accumulated: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    state = ctx.state
    had_residual = state.memory.residual(ctx.index) is not None
    rec = ctx.record(
        numel=accumulated.numel(), exchange="dense", k=accumulated.numel(), leader=-1, t_compress=0.0,
        t_exchange=0.0, bytes_sent=accumulated.numel() * accumulated.element_size(), gain=1.0,
    )
    started = perf_counter()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        total = fut.value().div_(state.world_size)
        rec.t_exchange = perf_counter() - started
        ctx.measured(rec, "allreduce", rec.bytes_sent, rec.t_exchange)
        # Only a bucket that still carries a residual needs the (full-pass) check: a
        # non-finite step must not wipe the residual that the skipped step would have kept.
        if had_residual:
            rec.finite = bool(torch.isfinite(total).all())
            if rec.finite:
                state.memory.forget(ctx.index)
        return total

    return allreduce_sum(accumulated, state.process_group).then(finish)


def _exchange_allgather(ctx: _BucketContext, accumulated: torch.Tensor, k: int) -> torch.futures.Future[torch.Tensor]:
    state = ctx.state
    started = perf_counter()
    norm, finite = _norm_and_finiteness(accumulated)
    if state.compressor == "mstopk":
        indices = mstopk_indices(accumulated, k, state.mstopk_rounds)
    else:
        indices = topk_indices(accumulated, k, state._workspace(ctx.index))
    values = _contributed_values(accumulated, indices, finite)
    gain = _gain(values, norm)
    # MSTopk may find fewer than k; pad the message with zero values at index 0 so that
    # every rank's message has the same size (adding zeros changes nothing).
    padding = k - indices.numel()
    message = pack(torch.cat([values, values.new_zeros(padding)]), torch.cat([indices, indices.new_zeros(padding)]))
    rec = ctx.record(
        numel=accumulated.numel(), exchange="agtopk", k=k, leader=-1, t_compress=perf_counter() - started,
        t_exchange=0.0, bytes_sent=message.numel(), gain=gain,
    )
    launched = perf_counter()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        done = perf_counter()
        rec.t_exchange = done - launched
        all_values, all_indices = unpack_all(fut.value(), state.world_size, k, accumulated.dtype)
        rec.finite = bool(torch.isfinite(all_values).all())
        if rec.finite:
            state.memory.update(ctx.index, ctx.layout, accumulated, indices)
        accumulated.zero_()
        accumulated.index_add_(0, all_indices, all_values.div_(state.world_size))
        rec.t_compress += perf_counter() - done
        ctx.measured(rec, "allgather", rec.bytes_sent, rec.t_exchange)
        return accumulated

    return allgather(message, state.process_group).then(finish)


def _exchange_artopk(ctx: _BucketContext, accumulated: torch.Tensor, k: int) -> torch.futures.Future[torch.Tensor]:
    state = ctx.state
    world = state.world_size
    leader = state.leader_for(ctx.index, ctx.step)
    state.leader_counts[leader] += 1
    started = perf_counter()
    norm, finite = _norm_and_finiteness(accumulated)
    if state.rank == leader:
        indices = topk_indices(accumulated, k, state._workspace(ctx.index))
    else:
        indices = torch.empty(k, dtype=torch.int32, device=accumulated.device)
    t_compress = perf_counter() - started

    launched = perf_counter()
    broadcast_from(indices, leader, state.process_group)
    broadcasted = perf_counter()
    values = _contributed_values(accumulated, indices, finite)
    gain = _gain(values, norm)
    with_statistics = state.compressor == "artopk-var"
    if with_statistics:
        slots = values.new_zeros(world)
        # Clamped to the dtype's range: an fp16 norm can overflow while a_i is finite.
        slots[state.rank] = min(_var_statistic(accumulated, norm, state.var_statistic), torch.finfo(values.dtype).max)
        values = torch.cat([values, slots])
    rec = ctx.record(
        numel=accumulated.numel(), exchange="artopk", k=k, leader=leader,
        t_compress=t_compress + perf_counter() - broadcasted, t_exchange=0.0,
        bytes_sent=indices.numel() * indices.element_size() + values.numel() * values.element_size(), gain=gain,
    )
    reducing = perf_counter()

    def finish(fut: torch.futures.Future) -> torch.Tensor:
        reduced = fut.value()
        done = perf_counter()
        rec.t_exchange = done - launched
        rec.finite = bool(torch.isfinite(reduced).all())
        if rec.finite:
            state.memory.update(ctx.index, ctx.layout, accumulated, indices)
            if with_statistics:
                state._record_var_statistics(ctx.index, reduced[k:].double().tolist())
        accumulated.zero_()
        accumulated[indices.long()] = reduced[:k].div_(world)
        rec.t_compress += perf_counter() - done
        # Only the allreduce, timed from its own launch, is a clean network sample: a
        # non-leader's broadcast time includes its wait for the leader's top-k.
        ctx.measured(rec, "allreduce", values.numel() * values.element_size(), done - reducing)
        return accumulated

    return allreduce_sum(values, state.process_group).then(finish)


def _norm_and_finiteness(a: torch.Tensor) -> tuple[float, bool]:
    """``||a||_2`` (accumulated in fp32) and whether ``a`` is all finite, in one pass.

    A finite norm proves every element finite; only an overflowing norm needs the
    element-wise check.
    """
    norm = float(torch.linalg.vector_norm(a, dtype=torch.float32))
    finite = math.isfinite(norm) or bool(torch.isfinite(a).all())
    return norm, finite


def _contributed_values(a: torch.Tensor, indices: torch.Tensor, finite: bool) -> torch.Tensor:
    values = a.index_select(0, indices)
    if not finite:
        # Make the whole exchanged update non-finite on every rank, so that every rank
        # sees it (GradScaler skips the step) and every rank keeps its old residual.
        values.fill_(float("nan"))
    return values


def _gain(values: torch.Tensor, norm: float) -> float:
    if norm == 0.0 or not math.isfinite(norm):
        return 0.0 if norm == 0.0 else float("nan")
    return float(torch.linalg.vector_norm(values, dtype=torch.float32)) / norm


def _var_statistic(a: torch.Tensor, norm: float, statistic: str) -> float:
    if statistic == "norm":
        return norm
    return float(a.var(correction=0)) if a.numel() > 0 else 0.0


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")


def _check_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
