"""FlexState: the options, the step protocol and the checkpoint state of the hook.

The compressor table and the validated options live in :mod:`flexcomm.options`.

The step protocol, per DDP bucket.  On the autograd thread, :meth:`FlexState.hand_over`
only notes the bucket (its step, whether it opens or closes the step; the last bucket
advances the step) and the hook queues it on the state's :class:`~flexcomm.comm.Dispatcher`.
On the dispatcher's thread, in bucket order, :meth:`FlexState.prepare`: at the first bucket
ever, every rank compares a configuration fingerprint; at a step's first bucket the
previous step is settled (its device-side statistics read in one transfer) and the planner
begins the step (a due probe; at an agreement point it reads the agreement and decides);
then the bucket is planned (exchange, density), compensated (``a_i = g_i + e_i``) and
handed to its exchange as a :class:`~flexcomm.exchange.BucketJob`.  At the step's last
bucket ``prepare`` also queues the step's end behind that bucket's exchange, where the
planner issues the next agreement point's allreduces asynchronously: they travel during
the optimizer step and the next forward, not before the next step's first exchange
(:mod:`flexcomm.control.agreement_point`).  :meth:`FlexState.state_dict` waits for them.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from flexcomm import elastic, telemetry
from flexcomm.comm import Dispatcher, ExchangeStreams, agree_on_config, clock, exchange_context, mark_ready
from flexcomm.comm.clock import Mark
from flexcomm.compress import Layout, ResidualMemory, TopkWorkspace, check_index_range, k_for, make_selector
from flexcomm.compress.fused import Accumulation
from flexcomm.compress.lowrank import DEFAULT_RANK, LowRankQueries
from flexcomm.compress.mstopk import DEFAULT_ROUNDS
from flexcomm.compress.stats import sample_size, sampled
from flexcomm.control import DensityController, ExchangeChooser, StepPlanner
from flexcomm.control.quality import QUALITY_EVERY, measures_quality
from flexcomm.exchange import DENSE_EXCHANGES, BucketJob, LeaderPolicy, make_leader_policy
from flexcomm.exchange.job import BucketRecord, DeviceOutcome
from flexcomm.options import FlexOptions
from flexcomm.settlement import Settlement
from flexcomm.version import __version__

_STATE_FORMAT = 2


@dataclass(frozen=True)
class HandedBucket:
    """A bucket as DDP handed it over: its buffer, index, layout, step, whether it opens and whether
    it closes the step (DDP's last bucket), and (CUDA) the event after which its buffer is written."""

    grad: torch.Tensor
    index: int
    layout: Layout
    step: int
    opens_step: bool
    closes_step: bool
    ready: torch.cuda.Event | None = None
    shapes: tuple[tuple[int, ...], ...] = ()


class FlexState:
    """Everything the hook keeps between calls: configuration, residuals, counters, records.

    Args:
        process_group: the group to communicate over (``None``: the default group); only this
            state's collectives may run on it (see :func:`flexcomm.comm.own_group`).
        compressor: one of :data:`flexcomm.options.COMPRESSORS`.
        density: fraction of each bucket's elements sent, in (0, 1], or ``"auto"``.
        controller: the :class:`DensityController` of ``density="auto"`` (default settings if None).
        warmup_steps: exchange dense for the first this many steps.
        mstopk_rounds: threshold-search rounds of ``mstopk``.
        var_statistic: ``artopk-var``'s statistic, ``"norm"`` (the authors') or ``"variance"``.
        var_smoothing: EWMA factor ``s <- smoothing * s + (1 - smoothing) * x``, in [0, 1).
        flex_interval: ``flex`` agrees on measured times and re-decides every this many steps.
        probe_every: ``flex`` re-probes the collectives every this many steps.
        probe_sizes: message sizes in bytes the probe times.  Keep them above a shaped link's
            burst (tbf lets a few hundred KB through faster than the rate).  A larger size is cut
            where the smaller one says it would take over ~25 ms (:func:`flexcomm.cost.probe_size`).
        forgetting: the (alpha, beta) estimator's forgetting factor per sample, in (0, 1]:
            lower follows a changing network faster, higher averages out more noise.
        max_records: how many :class:`BucketRecord` are kept until :meth:`drain_records`.
        dense16: ``flex`` may allreduce a bucket of fp32 gradients in fp16 (``dense16``, what
            PyTorch's ``fp16_compress_hook`` sends) where that makes the step fastest; ``False``
            keeps its dense choice in the gradients' own dtype.
        rank: the rank of ``lowrank``'s factors (the compressor, and ``flex``'s low-rank choice).
        lowrank: ``flex`` may send a bucket as rank-``rank`` factors (``lowrank``) where that makes the
            step fastest for the steps it costs (charged by its measured quality,
            :func:`flexcomm.control.quality.quality_factor`); ``False`` keeps it to dense and top-k.
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
        dense16: bool = True,
        rank: int = DEFAULT_RANK,
        lowrank: bool = True,
    ) -> None:
        self.options = options = FlexOptions(
            compressor, density, warmup_steps, mstopk_rounds, var_statistic, var_smoothing,
            flex_interval, probe_every, probe_sizes, forgetting, max_records, dense16, rank, lowrank,
        )
        if density == "auto":
            controller = controller or DensityController()
        elif controller is not None:
            raise ValueError("controller is only used with density='auto'")
        roles = options.roles
        self.process_group = process_group
        self.planner = StepPlanner(
            exchange=roles.exchange, density=None if controller else float(density), controller=controller,
            warmup_steps=warmup_steps, flex_interval=flex_interval, probe_every=probe_every,
            probe_sizes=options.probe_sizes, forgetting=forgetting, group=process_group, dense16=dense16,
            lowrank=lowrank,
        )
        self.selector = make_selector(roles.selector, mstopk_rounds) if roles.selector else None
        self._exact_top_k = roles.selector == "topk"
        self.leaders: LeaderPolicy | None = make_leader_policy(roles.leader, var_statistic, var_smoothing) if roles.leader else None
        self.step = 0
        self.memory = ResidualMemory()
        self.low_rank = LowRankQueries(rank)
        # Whether flex may choose the low-rank exchange; whether any exchange here may be low-rank.
        self._low_rank_choice = roles.exchange is None and lowrank
        self._low_rank_possible = self._low_rank_choice or roles.exchange == "lowrank"
        self.records: deque[BucketRecord] = deque(maxlen=max_records)
        self.dispatcher = Dispatcher()
        self.streams = ExchangeStreams()
        self._workspaces: dict[int, TopkWorkspace] = {}
        self._in_step = False
        self._config_checked = False
        self._param_names: dict[int, str] | None = None
        # The task that ends the latest step on the dispatcher (see prepare()), until it is awaited.
        self._step_end: torch.futures.Future | None = None
        # The exchanges' results not yet fed back to records, planner, leaders and memory (see settle()).
        self.settlement = Settlement(self.planner, self.memory, self.leaders, process_group)

    @property
    def compressor(self) -> str:
        return self.options.compressor

    @property
    def density(self) -> float:
        """The density in force now (the controller's choice under ``density="auto"``)."""
        return self.planner.density

    @property
    def chooser(self) -> ExchangeChooser:
        """``flex``'s exchange chooser (its cost estimate and choices)."""
        return self.planner.chooser

    @property
    def controller(self) -> DensityController | None:
        """The density controller of ``density="auto"`` (else ``None``)."""
        return self.planner.controller

    @property
    def world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    @property
    def rank(self) -> int:
        return dist.get_rank(self.process_group)

    @property
    def leader_counts(self) -> list[int]:
        """How many bucket exchanges each rank was AR-Topk's index source for."""
        counts = self.leaders.counts if self.leaders else []
        return counts + [0] * (self.world_size - len(counts))

    def drain_records(self) -> list[BucketRecord]:
        """Return and forget the records collected since the last call (call it between steps)."""
        self.settle()
        drained = list(self.records)
        self.records.clear()
        return drained

    def metrics(self) -> dict[str, float]:
        """This rank's metrics of the newest step and the last decisions (keys: :mod:`flexcomm.telemetry`).

        Reads the records without draining them, so :meth:`drain_records` still returns every
        record; records already drained are gone, so an app that drains each step passes the
        step's records to :func:`flexcomm.telemetry.metrics`.  Call it between steps; no collective.
        """
        return telemetry.metrics(self)

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Residuals, counters and smoothed statistics of this rank, for a checkpoint."""
        self._await_step_end()
        self.settle()
        return {
            "format": _STATE_FORMAT,
            "compressor": self.compressor,
            "density": self.density,
            "world_size": self.world_size,
            "rank": self.rank,
            "step": self.step,
            "memory": self.memory.state_dict(),
            "leaders": self.leaders.state_dict() if self.leaders else None,
            "planner": self.planner.state_dict(),
            "low_rank": self.low_rank.state_dict(),
        }

    def load_state_dict(
        self, state: dict[str, Any], departed_states: Sequence[dict[str, Any]] = (), residuals: str = "fold",
    ) -> None:
        """Restore :meth:`state_dict`; refuses another rank's state or another compressor.

        A state saved at another world size loads (before the first step) under the policy
        of :mod:`flexcomm.elastic`: a remaining rank passes its own saved state and, with
        ``residuals="fold"`` (default), the ``departed_states`` folded into it
        (:func:`flexcomm.elastic.sources` names them); ``residuals="drop"`` drops them.
        """
        if state.get("format") != _STATE_FORMAT:
            raise ValueError(f"unsupported FlexState checkpoint format {state.get('format')!r} (this version writes {_STATE_FORMAT})")
        if state["compressor"] != self.compressor:
            raise ValueError(f"checkpoint was written with compressor={state['compressor']!r}, this run has compressor={self.compressor!r}")
        if state["world_size"] != self.world_size:
            if self._config_checked:  # the planner and leaders already hold this job's measurements
                raise RuntimeError("load a state saved at another world size before the first step (into a new FlexState)")
            elastic.load_resized(self, state, departed_states, residuals)
            return
        if departed_states:
            raise ValueError("departed_states only apply to a state saved at another world size")
        self._await_step_end()  # the step's end must not issue an agreement from the state replaced here
        if state["rank"] != self.rank:
            raise ValueError(
                f"this FlexState checkpoint belongs to rank {state['rank']} of {state['world_size']}, but it is being "
                f"loaded on rank {self.rank}: residuals are per rank, so every rank must load the state it saved "
                "(save one state_dict per rank)"
            )
        self.planner.load_state_dict(state["planner"])
        self.step = int(state["step"])
        self.memory.load_state_dict(state["memory"])
        if self.leaders:
            self.leaders.load_state_dict(state["leaders"])
        if "low_rank" in state:  # states saved before the low-rank exchange have none
            self.low_rank.load_state_dict(state["low_rank"])

    # ------------------------------------------------------------------ the step protocol

    def bind_parameters(self, named_parameters: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
        """Name the model's parameters, so residuals are kept per parameter (see :func:`flexcomm.register`)."""
        if self.step:
            raise RuntimeError("bind_parameters must be called before the first step")
        self._param_names = {id(p): name for name, p in named_parameters}
        self.memory.named = True

    def fingerprint(self, first_bucket: torch.Tensor) -> dict[str, object]:
        """Everything that must be equal on all ranks for their exchanges to match."""
        o = self.options
        return {
            "flexcomm": __version__,
            "compressor": o.compressor,
            **self.planner.fingerprint(),
            "mstopk_rounds": o.mstopk_rounds,
            "rank": o.rank,
            "var": (o.var_statistic, o.var_smoothing),
            "flex": (o.flex_interval, o.probe_every, o.probe_sizes, o.forgetting),
            "first_bucket": (first_bucket.numel(), str(first_bucket.dtype)),
        }

    def advance(self, last_bucket: bool) -> None:
        """Count a bucket handed over; the step's last bucket ends the step."""
        if last_bucket:
            self.step += 1
            self._in_step = False

    def hand_over(self, bucket: dist.GradBucket) -> HandedBucket:
        """Note a bucket DDP handed over (autograd thread): no collective, no tensor work (on a GPU, one event)."""
        grad, last = bucket.buffer(), bucket.is_last()
        # Parameter shapes only where the low-rank exchange can run: it factors them.
        shapes = tuple(tuple(p.shape) for p in bucket.parameters()) if self._low_rank_possible else ()
        handed = HandedBucket(grad, bucket.index(), self._layout(bucket), self.step, not self._in_step, last,
                              mark_ready(grad), shapes)
        self._in_step = True
        self.advance(last)
        return handed

    def prepare(self, handed: HandedBucket) -> BucketJob:
        """The step protocol for one bucket (dispatcher thread, bucket order): returns its job."""
        grad, index, step = handed.grad, handed.index, handed.step
        if not self._config_checked:
            agree_on_config(self.fingerprint(grad), self.process_group)
            self._config_checked = True
        if handed.opens_step:
            self.settle()
            self.planner.begin_step(step)
        numel = grad.numel()
        plan = self.planner.plan(index, numel, grad.element_size(), step, self._factor_size(handed))
        dense = plan.exchange in DENSE_EXCHANGES
        if not dense:
            check_index_range(numel)
        k = numel if dense else k_for(numel, plan.density)
        leader = self.leaders.take(index, step, self.world_size) if plan.exchange == "artopk" else -1
        low_rank = (self.low_rank.bucket(index, handed.layout, handed.shapes, grad.device, self.memory.named)
                    if plan.exchange == "lowrank" else None)
        workspace = self._workspaces.setdefault(index, TopkWorkspace())
        accumulation, span = None, None
        # flex charges the low-rank exchange by its update's quality, measured on a sample of g / N.
        sample, sampled_grad = sampled(grad, step, self.world_size) \
            if plan.exchange == "lowrank" and self.planner.estimating and measures_quality(step, plan.explored) \
            else (None, None)
        if dense:
            accumulated = self.memory.compensate(index, handed.layout, grad)
        else:
            # A rank that selects with the exact top-k selects during the accumulation pass.
            selects = self._exact_top_k and (plan.exchange == "agtopk" or leader == self.rank)
            accumulation, span = self._accumulate(handed, k if selects else None, workspace)
            accumulated = accumulation.a
        if self.planner.measuring_gain:
            self.planner.observe_gain(index, accumulated, workspace)
        record = BucketRecord(
            step=step, bucket=index, numel=numel, exchange=plan.exchange, k=k, leader=leader, t_compress=0.0,
            t_exchange=0.0, bytes_sent=0, gain=math.nan, predicted=plan.predicted, density=plan.density,
            explored=plan.explored,
        )
        outcome = DeviceOutcome()
        self.records.append(record)
        self.settlement.expect(record, outcome)
        if handed.closes_step and self.planner.estimating:
            # Queued from the dispatcher thread while it runs this bucket: it runs right after
            # this bucket's exchange is issued, before any bucket of the next step.
            self._step_end = self.dispatcher.submit(partial(self._end_step, handed))
        return BucketJob(
            grad=grad, accumulated=accumulated, index=index, layout=handed.layout, k=k, step=step,
            group=self.process_group, world_size=self.world_size, rank=self.rank, memory=self.memory, workspace=workspace,
            record=record, outcome=outcome, measured=self.settlement.measured, selector=self.selector, leaders=self.leaders,
            accumulation=accumulation, accumulation_span=span, leader=leader, low_rank=low_rank,
            sample=sample, sampled_grad=sampled_grad, defer=self.dispatcher.deferred.defer,
        )

    def _factor_size(self, handed: HandedBucket) -> tuple[int, int] | None:
        """``flex``'s low-rank payload of the bucket (its two allreduces' elements), None where it has no choice of it."""
        if not self._low_rank_choice:
            return None
        split = self.low_rank.split(handed.index, handed.shapes)
        # The model plans on the mean payload: the sample rides on one step in QUALITY_EVERY.
        return split.payload(math.ceil(sample_size(handed.grad.numel()) / QUALITY_EVERY)) if split.matrices else None

    def _accumulate(self, handed: HandedBucket, k: int | None, workspace: TopkWorkspace) -> tuple[Accumulation, tuple[Mark, Mark]]:
        """The memory's accumulation pass for a sparse exchange, with its time marks (the exchange's local work).

        A bucket's first buffer is allocated before the clock starts: mapping it is a
        one-time cost, which flex's model would otherwise charge the exchange every step.
        """
        self.memory.reserve(handed.index, handed.grad)
        started = clock.now(handed.grad.device)
        accumulation = self.memory.accumulate(handed.index, handed.layout, handed.grad, k, workspace)
        return accumulation, (started, clock.now(handed.grad.device))

    def _end_step(self, handed: HandedBucket) -> torch.futures.Future[None]:
        """The dispatcher task after a step's last exchange: the planner issues the next agreement."""
        with exchange_context(handed.grad.device, None, self.streams):  # the control tensors' device
            self.planner.end_step(handed.step)
        done: torch.futures.Future[None] = torch.futures.Future()
        done.set_result(None)
        return done

    def _await_step_end(self) -> None:
        """Wait until the latest step's end ran on the dispatcher (re-raising its error)."""
        if self._step_end is not None:
            self._step_end.wait()
            self._step_end = None

    def settle(self) -> None:
        """Read the finished buckets' device-side outcomes in one transfer and apply them (:class:`Settlement`).

        Runs at each step's first bucket and when records or the checkpoint state are read.
        """
        self.settlement.settle()

    def _layout(self, bucket: dist.GradBucket) -> Layout:
        params = bucket.parameters()
        if self._param_names is None:
            return tuple((str(tuple(p.shape)), p.numel()) for p in params)
        return tuple((self._param_names[id(p)], p.numel()) for p in params)
