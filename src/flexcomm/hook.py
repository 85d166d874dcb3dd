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
                 lowest rank (see :mod:`flexcomm.exchange.leaders`).
``lowrank``      PowerSGD's subspace iteration with warm start: each matrix-shaped
                 ``M_i`` is sent as ``P = orth(sum_i M_i Q)`` and ``Q_i = M_i^T P`` in two
                 allreduces; the update is ``P (sum_i Q_i)^T / N``; rank i keeps
                 ``M_i - P Q_i^T`` (see :mod:`flexcomm.compress.lowrank`).
``flex``         per bucket, whichever of dense, dense16 (``a_i / N`` allreduced in fp16,
                 as PyTorch's ``fp16_compress_hook``), agtopk, artopk-star and lowrank the
                 alpha-beta model (plus measured local work) predicts makes the step
                 fastest now for the steps it costs; see :mod:`flexcomm.control.planner`.

``density="auto"`` lets a :class:`~flexcomm.control.DensityController` move the density
along the Pareto front of compression gain and step time (see :mod:`flexcomm.control.density`).

Error feedback: the new residual is ``e_i = a_i`` with the sent indices zeroed, so what
rank i contributed plus its residual equals ``a_i``.  A non-finite ``a_i`` on any rank
turns the exchanged values into NaN on every rank (so ``torch.amp.GradScaler`` sees it and
skips the step) and every rank drops its residual (it holds the skipped step's gradient).

The roles: :mod:`flexcomm.state` (options, step protocol, the compressor table),
:mod:`flexcomm.control` (decisions), :mod:`flexcomm.compress` (selection, residuals),
:mod:`flexcomm.exchange` (collectives per exchange), :mod:`flexcomm.comm` (collectives).
"""

from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from flexcomm.comm import exchange_context, fail_halves, future_devices, own_group, run_halves
from flexcomm.exchange import EXCHANGES
from flexcomm.state import FlexState, HandedBucket

_NOT_WRAPPED = (
    "flexcomm.register needs a torch.nn.parallel.DistributedDataParallel model, got {kind}: call it after the "
    "model is wrapped in DDP (plain PyTorch: flexcomm.register(DDP(model), ...); Lightning: use "
    "flexcomm.lightning.FlexCommStrategy instead of calling register; Accelerate: call "
    "flexcomm.accelerate.register(accelerator, model, ...) after accelerator.prepare; Transformers' Trainer: call "
    "flexcomm.transformers.register(trainer, ...) after building the Trainer, before trainer.train())"
)


def register(ddp_model: DistributedDataParallel, state: FlexState | None = None, **state_args: Any) -> FlexState:
    """Register :func:`hook` on ``ddp_model`` with its parameter names; return the state.

    Equivalent to ``ddp_model.register_comm_hook(state, hook)``, plus names: residuals are
    then kept per parameter, so they survive DDP's bucket rebuild and checkpoints restore
    them under any bucket layout.  Pass a ``state`` or the arguments of :class:`FlexState`.

    A state made here gets a process group of its own with DDP's ranks (see
    :func:`flexcomm.comm.own_group`): DDP's own collectives (``find_unused_parameters``,
    ``static_graph``), other DDP models and the script's collectives cannot interleave
    with the hook's.  Every rank must call ``register`` at the same point, as it builds DDP.
    A ``state`` passed in keeps the group it was given.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(_NOT_WRAPPED.format(kind=type(ddp_model).__name__))
    if state is None:
        state = FlexState(process_group=own_group(ddp_model.process_group), **state_args)
    elif state_args:
        raise TypeError("pass either a FlexState or FlexState arguments, not both")
    state.bind_parameters(ddp_model.module.named_parameters())
    ddp_model.register_comm_hook(state, hook)
    return state


def hook(state: FlexState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: exchange one bucket as ``state.compressor`` says.

    Returns at once a future holding the bucket's averaged (sparse or dense) update: the
    bucket's work and collectives run on the state's dispatcher thread, in bucket order
    (see :mod:`flexcomm.comm.dispatch`), so backward never waits for the network.  On a
    GPU that work runs on the hook's exchange stream once the bucket is written, and the
    future carries the bucket's device (see :mod:`flexcomm.comm.streams`).
    """
    grad = bucket.buffer()
    if not grad.is_floating_point():
        raise TypeError(f"flexcomm.hook needs floating-point gradients, got dtype {grad.dtype}")
    if state.world_size == 1:
        state.advance(bucket.is_last())
        return _completed(grad)
    handed = state.hand_over(bucket)
    return state.dispatcher.submit(partial(_exchange, state, handed), devices=future_devices(grad))


def _exchange(state: FlexState, handed: HandedBucket) -> torch.futures.Future[torch.Tensor]:
    """On the dispatcher thread, in bucket order: the step protocol, then the bucket's exchange."""
    with exchange_context(handed.grad.device, handed.ready, state.streams):
        deferred = state.dispatcher.deferred
        earlier = deferred.take()
        try:
            job = state.prepare(handed)
            issued = EXCHANGES[job.record.exchange](job)
        except BaseException as err:
            fail_halves(earlier, err)  # the dispatcher fails the halves still deferred
            raise
        # The earlier buckets' second halves go after this bucket's first collectives; the step's
        # last bucket runs its own too (see flexcomm.comm.dispatch, "Second halves").
        run_halves(earlier + deferred.take() if handed.closes_step else earlier)
        return issued


def _completed(tensor: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future(devices=future_devices(tensor))
    fut.set_result(tensor)
    return fut
