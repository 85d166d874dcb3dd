"""The run's gradient exchange: flexcomm's hook or a PyTorch baseline, timed per step.

:class:`TimedHook` is registered with DDP in place of the bare hook and calls it for
every bucket.  Wrapping lets the training loop

* measure what the hook costs the step: time blocked inside the hook (compression, the
  AR-Topk index broadcast) and the tail of backward spent waiting for exchanges still
  in flight after the last bucket was handed over;
* time PyTorch's hooks (PowerSGD, fp16; see :mod:`flexcomm.train.baselines`), which
  keep no records of their own;
* prime DDP's buckets: DDP regroups gradients into new buckets after its first
  backward, and every compressor's error-feedback memory is per bucket.  One backward
  pass that communicates nothing, before training, makes step 0 of a fresh run and
  the first step of a resumed run see the same buckets as every later step, so no
  residual is dropped and a resumed run continues exactly where it stopped.
"""

import math
import statistics
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import flexcomm
from flexcomm.comm import own_group
from flexcomm.control import DensityController
from flexcomm.train import baselines
from flexcomm.train.config import TORCH_COMPRESSORS, TrainConfig


@dataclass
class StepComm:
    """What the exchanges of one step did, as this rank saw them.

    ``t_compress``: compression time (flexcomm: from its records; PyTorch hooks: the
    hook's synchronous part).  ``t_sync``: sum over buckets of exchange time, which
    partly overlaps backward.  ``t_wait``: how long backward was held up by
    communication (blocked inside hooks, plus waiting for the last exchanges).
    ``density``: elements exchanged / gradient elements.  ``explored``: some bucket ran
    ``flex``'s exploration of an alternative exchange, not its plan's.  ``quality``: the mean
    over buckets that measured it of ``cos(update, mean gradient)`` (``flex``'s low-rank exchange).
    """

    t_compress: float
    t_sync: float
    t_wait: float
    bytes_sent: int
    density: float
    exchanges: list[str]
    leaders: list[int]
    gain: float | None
    finite: bool
    explored: bool = False
    quality: float | None = None


@dataclass
class _BucketTally:
    """Per-step accumulators for hooks that keep no records (PyTorch's)."""

    numel: int = 0
    sent: int = 0
    bytes_sent: int = 0
    t_sync: float = 0.0
    exchanges: set[str] = field(default_factory=set)


class TimedHook:
    """The comm hook of ``cfg.compressor``, wrapped for timing and bucket priming."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.compressor = cfg.compressor
        self.state: Any = _make_state(cfg)
        self._inner = _inner_hook(cfg.compressor)
        self._priming = False
        self._in_hook = 0.0
        self._last_return = 0.0
        self._tally = _BucketTally()
        self._handed = 0
        #: DDP buckets the last finished step handed over (0 before the first).
        self.buckets = 0

    @property
    def is_flexcomm(self) -> bool:
        return isinstance(self.state, flexcomm.FlexState)

    def register(self, ddp: DistributedDataParallel) -> None:
        ddp.register_comm_hook(self, _timed_hook)

    def prime(self, ddp: DistributedDataParallel, x: torch.Tensor, y: torch.Tensor) -> None:
        """One forward/backward without communication, so that DDP rebuilds its buckets now.

        Parameters, buffers (BatchNorm statistics) and the RNG are left as they were, so
        priming changes nothing but DDP's bucket layout.
        """
        module = ddp.module
        buffers = [b.detach().clone() for b in module.buffers()]
        devices = [x.device] if x.device.type == "cuda" else []
        self._priming = True
        try:
            with torch.random.fork_rng(devices=devices):
                F.cross_entropy(ddp(x), y).backward()
        finally:
            self._priming = False
        with torch.no_grad():
            for saved, live in zip(buffers, module.buffers()):
                live.copy_(saved)
        for p in module.parameters():
            p.grad = None

    def exchange(self, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        """Called by DDP for every bucket: run the real hook and time it."""
        entered = perf_counter()
        if self._priming:
            return _completed(bucket.buffer())
        self._handed += 1
        if self.is_flexcomm:
            fut = self._inner(self.state, bucket)
        else:
            fut = self._exchange_torch(bucket, entered)
        self._last_return = perf_counter()
        self._in_hook += self._last_return - entered
        return fut

    def _exchange_torch(self, bucket: dist.GradBucket, entered: float) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        numel, size = buffer.numel(), buffer.element_size()
        if self.compressor == "fp16":
            sent, exchange = numel, "fp16"
            nbytes = numel * 2
            fut = self._inner(None, bucket)
        else:
            compressing = self.state.iter >= self.state.start_powerSGD_iter
            before = self.state.total_numel_after_compression
            fut = self._inner(self.state, bucket)
            sent = self.state.total_numel_after_compression - before if compressing else numel
            exchange = "powersgd" if compressing else "allreduce"
            nbytes = sent * size
        tally = self._tally
        tally.numel += numel
        tally.sent += sent
        tally.bytes_sent += nbytes
        tally.exchanges.add(exchange)
        return fut.then(partial(self._stamp_done, entered))

    def _stamp_done(self, entered: float, fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
        self._tally.t_sync += perf_counter() - entered
        return fut.value()

    def begin_step(self) -> None:
        self._in_hook = 0.0
        self._last_return = perf_counter()
        self._tally = _BucketTally()
        self._handed = 0

    def end_step(self, backward_end: float) -> StepComm:
        """Summarise the step's exchanges; call right after backward returned."""
        tail = max(0.0, backward_end - self._last_return)
        self.buckets = self._handed
        if self.is_flexcomm:
            return _summarise_records(self.state.drain_records(), self._in_hook, tail)
        tally = self._tally
        return StepComm(
            t_compress=self._in_hook,
            t_sync=tally.t_sync,
            t_wait=tail,
            bytes_sent=tally.bytes_sent,
            density=tally.sent / tally.numel if tally.numel else 1.0,
            exchanges=sorted(tally.exchanges),
            leaders=[],
            gain=None,
            finite=True,
        )

    @property
    def leader_counts(self) -> list[int] | None:
        """How often each rank was AR-Topk's index source (flexcomm compressors only)."""
        return list(self.state.leader_counts) if self.is_flexcomm else None

    @property
    def density_decisions(self) -> list[dict[str, Any]] | None:
        """The ``density="auto"`` controller's decisions, each with both objectives of every candidate."""
        controller = self.state.controller if self.is_flexcomm else None
        return list(controller.decisions) if controller else None

    def state_dict(self) -> dict[str, Any]:
        if self.is_flexcomm:
            return self.state.state_dict()
        if self.compressor == "powersgd":
            return baselines.powersgd_state_dict(self.state)
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.is_flexcomm:
            self.state.load_state_dict(state)
        elif self.compressor == "powersgd":
            baselines.powersgd_load_state_dict(self.state, state)


def _timed_hook(state: TimedHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP's entry point (DDP requires a function whose second argument is named ``bucket``)."""
    return state.exchange(bucket)


def _make_state(cfg: TrainConfig) -> Any:
    if cfg.compressor in TORCH_COMPRESSORS:
        return baselines.make_state(cfg)
    if cfg.density is None:
        raise ValueError(f"--compressor {cfg.compressor} needs a --density")
    controller = None
    if cfg.density == "auto":
        controller = DensityController(rule=cfg.auto_rule, warmup_steps=cfg.auto_warmup, measure_every=cfg.auto_every,
                                       min_gain=cfg.auto_min_gain)
    # A group of the hook's own (every rank builds it here, at the same point): flex's agreement
    # allreduce is issued when a step's last bucket is, and on DDP's group it would race DDP's
    # broadcast of BatchNorm buffers at the next forward ("Received data size doesn't match").
    rank = {"rank": cfg.powersgd_rank} if cfg.compressor == "lowrank" and cfg.powersgd_rank else {}
    return flexcomm.FlexState(process_group=own_group(None), compressor=cfg.compressor, density=cfg.density,
                              controller=controller, warmup_steps=cfg.warmup_steps, **rank)


def _inner_hook(compressor: str) -> Any:
    return baselines.hook_function(compressor) if compressor in TORCH_COMPRESSORS else flexcomm.hook


def _summarise_records(records: list[flexcomm.BucketRecord], in_hook: float, tail: float) -> StepComm:
    t_compress = sum(r.t_compress for r in records)
    numel = sum(r.numel for r in records)
    gains = [r.gain for r in records if math.isfinite(r.gain)]
    return StepComm(
        t_compress=t_compress,
        t_sync=sum(r.t_exchange for r in records),
        # In-hook time beyond compression is spent blocked on collectives (index broadcast).
        t_wait=max(0.0, in_hook - t_compress) + tail,
        bytes_sent=sum(r.bytes_sent for r in records),
        density=sum(r.k for r in records) / numel if numel else 1.0,
        exchanges=sorted({r.exchange for r in records}),
        leaders=sorted({r.leader for r in records if r.leader >= 0}),
        gain=sum(gains) / len(gains) if gains else None,
        finite=all(r.finite for r in records),
        explored=any(r.explored for r in records),
        quality=statistics.fmean(qualities) if (qualities := [r.quality for r in records if math.isfinite(r.quality)]) else None,
    )


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(tensor)
    return fut
