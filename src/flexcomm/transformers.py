"""flexcomm in Hugging Face Transformers: ``flexcomm.transformers.register(trainer, compressor=..., density=...)``.

Needs the optional extra: ``pip install flexcomm[transformers]``.  Call it on every rank,
after the :class:`~transformers.Trainer` is built and before ``trainer.train()``.

Trainer wraps the model in DistributedDataParallel only inside ``train()``, so
:func:`register` adds a :class:`FlexCommCallback` that registers flexcomm's hook on
``trainer.model_wrapped`` when training begins (once per DDP wrapper: DDP takes one comm
hook, and a second ``train()`` keeps the first one's hook and state).

What is saved where: whenever Trainer saves a checkpoint, every rank writes its own
:meth:`flexcomm.FlexState.state_dict` (error-feedback residuals, step, the planner's and
the leader policy's state) to ``<output_dir>/checkpoint-<global_step>/flexcomm_rank<r>.pt``,
``r`` being the rank (Trainer's ``args.process_index``), beside Trainer's own per-rank
``rng_state_<r>.pth``.  Residuals differ per rank, so each rank keeps a file of its own;
on resume rank ``r`` loads only ``flexcomm_rank<r>.pt``, and
:meth:`flexcomm.FlexState.load_state_dict` refuses a state another rank wrote.

How the resume is found: Trainer does not tell callbacks which checkpoint it resumes
from, so :func:`register` wraps this trainer's ``train`` method and reads its
``resume_from_checkpoint`` argument: a path is used as given, ``True`` means the newest
``checkpoint-N`` in ``args.output_dir`` (as Trainer itself resolves it).
``TrainingArguments.resume_from_checkpoint`` is ignored, as Trainer ignores it (it is for
scripts to pass to ``train``).  A resumed checkpoint without flexcomm files (saved
without flexcomm) gives one warning, on rank 0, and the hook starts from zero residuals;
one with files for some ranks only (another world size) is an error.

Telemetry: Trainer's training log rows (every ``logging_steps``, the rows with ``loss``)
also carry the rank's :meth:`flexcomm.FlexState.metrics` (keys ``flexcomm/...``, see
:mod:`flexcomm.telemetry`), so they reach ``trainer.state.log_history`` and every
``report_to`` integration, which report rank 0's; :func:`register` wraps this trainer's
``log`` method to add them.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import warnings
from collections.abc import Callable
from functools import wraps
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import flexcomm

__all__ = ["FlexCommCallback", "register", "state_file"]


def state_file(rank: int) -> str:
    """The name of rank ``rank``'s flexcomm state file in a Trainer checkpoint directory."""
    return f"flexcomm_rank{rank}.pt"


def register(trainer: Trainer, **state_args: Any) -> FlexCommCallback:
    """Make ``trainer`` train with flexcomm's hook and keep every rank's hook state in its checkpoints.

    ``state_args`` are :class:`flexcomm.FlexState`'s arguments (``compressor``, ``density``,
    ...), checked here.  Returns the callback added to the trainer; its ``state`` is the
    registered :class:`flexcomm.FlexState` from the start of training on.  Raises at once
    if this run cannot use the hook: one process, FSDP or DeepSpeed.
    """
    _check_parallelism(trainer)
    _check_state_args(state_args)
    if any(isinstance(callback, FlexCommCallback) for callback in trainer.callback_handler.callbacks):
        raise ValueError("flexcomm.transformers.register was already called on this Trainer; call it once")
    callback = FlexCommCallback(trainer, state_args)
    trainer.add_callback(callback)
    trainer.train = _recording_resume(trainer.train, trainer.args, callback)
    trainer.log = _adding_metrics(trainer.log, callback)
    return callback


class FlexCommCallback(TrainerCallback):
    """Registers flexcomm's hook when training begins; saves and restores each rank's hook state.

    Made by :func:`register`, which also sets :attr:`resume_from` at each ``train()`` call.
    """

    def __init__(self, trainer: Trainer, state_args: dict[str, Any]) -> None:
        self.trainer = trainer
        self.state_args = state_args
        self.state: flexcomm.FlexState | None = None
        #: The checkpoint directory the current ``train()`` resumes from, or None.
        self.resume_from: str | None = None
        self._wrapper: DistributedDataParallel | None = None  # the DDP model self.state is registered on

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Register the hook on the DDP model (if not yet registered on it), then load this rank's saved state.

        Raises TypeError, naming the wrapper, if Trainer did not wrap the model in DDP.
        """
        ddp = _ddp_model(self.trainer.model_wrapped)
        if ddp is not self._wrapper:
            self.state = flexcomm.register(ddp, **self.state_args)
            self._wrapper = ddp
        if self.resume_from is not None:
            _load_own_state(self.state, self.resume_from, args)

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """Write this rank's hook state into the checkpoint directory Trainer has just written.

        That is ``<output_dir>/checkpoint-<global_step>``, Trainer's directory outside a
        hyperparameter search (whose per-trial run directories are not followed).
        """
        if self.state is None:
            return
        directory = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        # A rank can get here before rank 0 has made the directory: Trainer's own RNG save makes it too.
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, state_file(args.process_index))
        # Written under another name first: a job killed mid-write leaves no truncated state to resume from.
        torch.save(self.state.state_dict(), path + ".tmp")
        os.replace(path + ".tmp", path)


def _check_parallelism(trainer: Trainer) -> None:
    """Refuse runs whose gradients DDP does not exchange: one process, FSDP, DeepSpeed."""
    if trainer.args.world_size < 2:
        raise ValueError(
            "flexcomm.transformers.register: this is a single-process run, so there are no gradients to exchange; "
            "launch 2 or more processes (e.g. torchrun --nproc-per-node 2 train.py)"
        )
    for enabled, name, option in ((trainer.is_fsdp_enabled, "FSDP", "fsdp"), (trainer.is_deepspeed_enabled, "DeepSpeed", "deepspeed")):
        if enabled:
            raise TypeError(
                f"flexcomm.transformers.register needs Trainer's DistributedDataParallel, but this Trainer uses {name}, "
                f"which exchanges gradients itself: remove `{option}` from TrainingArguments to use flexcomm"
            )


def _check_state_args(state_args: dict[str, Any]) -> None:
    """Check FlexState's argument names and option values now, not when training begins."""
    inspect.signature(flexcomm.FlexState).bind(None, **state_args)  # TypeError naming an unknown argument
    option_names = {field.name for field in dataclasses.fields(flexcomm.FlexOptions)}
    flexcomm.FlexOptions(**{name: value for name, value in state_args.items() if name in option_names})


def _ddp_model(model: nn.Module) -> DistributedDataParallel:
    """The DDP module Trainer trains, looking through ``torch.compile``'s wrapper (``torch_compile=True``)."""
    inner = getattr(model, "_orig_mod", model)
    if not isinstance(inner, DistributedDataParallel):
        raise TypeError(
            f"flexcomm.transformers.register needs Trainer to wrap the model in DistributedDataParallel, got "
            f"{type(model).__name__}: train with plain DDP (torchrun, no fsdp/deepspeed) to use flexcomm"
        )
    return inner


def _recording_resume(train: Callable[..., Any], args: TrainingArguments, callback: FlexCommCallback) -> Callable[..., Any]:
    """``train`` that first tells ``callback`` which checkpoint directory it resumes from."""
    signature = inspect.signature(train)

    @wraps(train)
    def train_with_flexcomm(*call_args: Any, **call_kwargs: Any) -> Any:
        resume = signature.bind(*call_args, **call_kwargs).arguments.get("resume_from_checkpoint")
        callback.resume_from = _checkpoint_dir(resume, args.output_dir)
        return train(*call_args, **call_kwargs)

    return train_with_flexcomm


def _adding_metrics(log: Callable[..., Any], callback: FlexCommCallback) -> Callable[..., Any]:
    """Trainer's ``log`` that adds the hook's metrics to training rows."""

    @wraps(log)
    def log_with_flexcomm(logs: dict[str, float], *args: Any, **kwargs: Any) -> Any:
        # Training rows carry "loss"; evaluation rows and the end-of-training summary do not.
        if callback.state is not None and "loss" in logs:
            logs = {**logs, **callback.state.metrics()}
        return log(logs, *args, **kwargs)

    return log_with_flexcomm


def _checkpoint_dir(resume: str | os.PathLike[str] | bool | None, output_dir: str) -> str | None:
    """The directory ``train(resume_from_checkpoint=resume)`` resumes from, as Trainer resolves it."""
    if resume is None or resume is False:
        return None
    if resume is True:
        return get_last_checkpoint(output_dir)  # None: Trainer raises "No valid checkpoint found"
    return os.fspath(resume)


def _load_own_state(state: flexcomm.FlexState, checkpoint: str, args: TrainingArguments) -> None:
    """Load this rank's file from ``checkpoint``; all ranks agree first on whether the files are there.

    A collective over the default group: every rank runs it at the start of training.
    """
    path = os.path.join(checkpoint, state_file(args.process_index))
    found: list[Any] = [None] * args.world_size
    dist.all_gather_object(found, os.path.isfile(path))
    if not any(found):
        if args.process_index == 0:
            warnings.warn(
                f"flexcomm: the checkpoint {checkpoint} holds no flexcomm hook state (it was saved without "
                "flexcomm.transformers.register); the hook starts from step 0 with zero residuals",
                stacklevel=2,
            )
        return
    if not all(found):
        missing = [rank for rank, there in enumerate(found) if not there]
        raise RuntimeError(
            f"flexcomm: the checkpoint {checkpoint} has no {state_file(missing[0])} for ranks {missing} of "
            f"{args.world_size}: resume with the world size it was saved with, from a directory every rank can read"
        )
    # state_dict() holds CPU tensors; the hook moves residuals to the gradients' device at first use.
    state.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
