"""flexcomm in PyTorch Lightning: ``Trainer(strategy=FlexCommStrategy(compressor=..., density=...))``.

Needs the optional extra: ``pip install flexcomm[lightning]``.

:class:`FlexCommStrategy` is Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy`
plus four things Lightning's own ``ddp_comm_hook`` route does not do:

* it registers flexcomm on every device, CPU (gloo) included; Lightning registers comm
  hooks only on CUDA and silently trains plain DDP elsewhere;
* it registers through :func:`flexcomm.register`, so residuals are kept per parameter
  name and survive DDP's bucket rebuild and restarts;
* a Lightning checkpoint (``trainer.save_checkpoint``, ``ModelCheckpoint``) holds every
  rank's hook state, and ``fit(ckpt_path=...)`` gives each rank its own back.  Lightning
  writes the file from rank 0 only, so every rank's state is gathered there first; and it
  restores the checkpoint before the model is wrapped in DDP, so the states are kept
  until the hook is registered;
* rank 0's :meth:`flexcomm.FlexState.metrics` (keys ``flexcomm/...``, see
  :mod:`flexcomm.telemetry`) reach the trainer's loggers every ``log_every_n_steps``
  optimizer steps, through Lightning's own logging (so they share rows with the
  module's metrics), with no code in the LightningModule.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.nn.parallel import DistributedDataParallel

import flexcomm
from flexcomm.rank_states import CHECKPOINT_KEY, gather_rank_states, load_own_rank_state

__all__ = ["FlexCommStrategy"]

#: DDPStrategy arguments that would register a second, conflicting comm hook.
_HOOK_ARGUMENTS = ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper", "model_averaging_period")


class FlexCommStrategy(DDPStrategy):
    """DDP with flexcomm's communication hook, on any device.

    Args:
        compressor: one of :data:`flexcomm.COMPRESSORS`.
        density: fraction of each bucket's elements sent, in (0, 1], or ``"auto"``.
        state_options: further :class:`flexcomm.FlexState` arguments (``warmup_steps``,
            ``controller``, ...).
        **ddp_kwargs: everything else :class:`DDPStrategy` takes (``find_unused_parameters``,
            ``bucket_cap_mb``, ``timeout``, ``process_group_backend``, ...).

    After the model is wrapped (from ``on_fit_start`` on), :attr:`state` is the registered
    :class:`flexcomm.FlexState` (its records: ``strategy.state.drain_records()``).
    """

    strategy_name = "flexcomm"

    def __init__(
        self,
        compressor: str = "artopk-star",
        density: float | str = 0.01,
        state_options: Mapping[str, Any] | None = None,
        **ddp_kwargs: Any,
    ) -> None:
        conflicting = sorted(set(_HOOK_ARGUMENTS) & set(ddp_kwargs))
        if conflicting:
            raise TypeError(
                f"FlexCommStrategy registers flexcomm's hook itself; remove {', '.join(conflicting)} "
                "(for another hook, use Lightning's DDPStrategy)"
            )
        if compressor not in flexcomm.COMPRESSORS:
            raise ValueError(f"unknown compressor {compressor!r}; choose one of {', '.join(flexcomm.COMPRESSORS)}")
        super().__init__(**ddp_kwargs)
        self._state_args = {"compressor": compressor, "density": density, **(state_options or {})}
        self.state: flexcomm.FlexState | None = None
        self._saved_rank_states: list[dict[str, Any]] | None = None

    def setup(self, trainer: pl.Trainer) -> None:
        """DDPStrategy's setup, after adding the callback that logs flexcomm's metrics (once per trainer)."""
        if not any(isinstance(callback, _LogMetrics) for callback in trainer.callbacks):
            trainer.callbacks.append(_LogMetrics(self))
        super().setup(trainer)

    def _register_ddp_hooks(self) -> None:
        """Called by :meth:`configure_ddp` right after the model is wrapped (Lightning: CUDA only)."""
        if not isinstance(self.model, DistributedDataParallel):
            raise TypeError(f"expected the DDP-wrapped model here, got {type(self.model).__name__}")
        self.state = flexcomm.register(self.model, **self._state_args)
        if self._saved_rank_states is not None:
            load_own_rank_state(self.state, self._saved_rank_states)
            self._saved_rank_states = None

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Gather every rank's hook state into rank 0's ``checkpoint``, then write it as DDPStrategy does.

        Runs on every rank (``trainer.save_checkpoint`` and ``ModelCheckpoint`` call it on all).
        """
        if self.state is not None:
            rank_states = gather_rank_states(self.state)
            if rank_states is not None:
                checkpoint[CHECKPOINT_KEY] = rank_states
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Restore the model; keep the hook states until the hook is registered (or load them now)."""
        super().load_model_state_dict(checkpoint, strict=strict)
        rank_states = checkpoint.get(CHECKPOINT_KEY)
        if rank_states is None:
            rank_zero_warn("FlexCommStrategy: the checkpoint holds no flexcomm hook state; residuals start at zero")
        elif self.state is None:
            self._saved_rank_states = rank_states
        else:
            load_own_rank_state(self.state, rank_states)


class _LogMetrics(Callback):
    """Logs rank 0's ``strategy.state.metrics()`` after every ``log_every_n_steps``-th optimizer step.

    Through ``LightningModule.log_dict``: Lightning then writes them to every logger with
    the step and rows of the module's own metrics.  Only on the steps Lightning writes
    (global step a multiple of ``log_every_n_steps``, or the trainer stopping), because on a GPU
    reading the metrics waits for the step's device work.
    """

    def __init__(self, strategy: FlexCommStrategy) -> None:
        self.strategy = strategy

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        state = self.strategy.state
        every = trainer.log_every_n_steps
        if state is None or not trainer.is_global_zero or not trainer.loggers or not every:
            return
        if trainer.global_step % every and not trainer.should_stop:
            return
        metrics = state.metrics()
        if metrics:
            # rank_zero_only: the other ranks do not log, so Lightning must not wait for them.
            pl_module.log_dict(metrics, on_step=True, on_epoch=False, rank_zero_only=True)
