"""flexcomm in Hugging Face Accelerate: ``state = flexcomm.accelerate.register(accelerator, model, ...)``.

Needs the optional extra: ``pip install flexcomm[accelerate]``.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` knows only PyTorch's
built-in hooks (it accepts others silently and registers nothing), so flexcomm is
registered on the model that ``accelerator.prepare`` returned.  :func:`register` also
makes ``accelerator.save_state`` / ``load_state`` carry the hook state of every rank:
Accelerate writes registered objects from the main process only, so each rank's state is
gathered there, and on loading each rank takes its own entry.

With ``log_every=N``, the main process's :meth:`flexcomm.FlexState.metrics` (keys
``flexcomm/...``, see :mod:`flexcomm.telemetry`) go through ``accelerator.log`` to the
accelerator's trackers after every N-th step, with the hook's step as the step.  A step
is known finished only when the model runs forward again (the hook cannot tell from
inside backward whether DDP and the optimizer are done), so each due step is logged at
the next forward: the last step of a run is logged if the model runs once more (an
evaluation, say); else log it with ``accelerator.log(state.metrics())``.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import flexcomm
from flexcomm.rank_states import CHECKPOINT_KEY, gather_rank_states, load_own_rank_state

__all__ = ["register"]


def register(accelerator: Accelerator, model: nn.Module, log_every: int = 0, **state_args: Any) -> flexcomm.FlexState:
    """Register flexcomm's hook on ``model`` (as returned by ``accelerator.prepare``); return its state.

    ``log_every``: send the hook's metrics through ``accelerator.log`` every this many
    steps (0: never; see the module docstring).  ``state_args`` are
    :class:`flexcomm.FlexState`'s arguments (``compressor``, ``density``, ...).
    Call it after ``prepare`` and before ``load_state``, on every rank.
    """
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 0:
        raise ValueError(f"log_every must be an int >= 0 (0: no logging), got {log_every!r}")
    if not isinstance(model, DistributedDataParallel):
        if accelerator.num_processes < 2:
            raise ValueError(
                "flexcomm.accelerate.register: this is a single-process run, so there are no gradients to "
                "exchange; launch 2 or more processes (e.g. torchrun --nproc-per-node 2 train.py)"
            )
        raise TypeError(
            f"flexcomm.accelerate.register needs the model returned by accelerator.prepare(model), "
            f"got a {type(model).__name__} that is not wrapped in DistributedDataParallel: "
            "call it after prepare, with prepare's result"
        )
    state = flexcomm.register(model, **state_args)
    accelerator.register_for_checkpointing(_EveryRankState(state))
    if log_every and accelerator.is_main_process:
        model.register_forward_pre_hook(_LogMetrics(accelerator, state, log_every))
    return state


class _LogMetrics:
    """A forward pre-hook: at each forward, logs the step before it if that step is due and not logged yet."""

    def __init__(self, accelerator: Accelerator, state: flexcomm.FlexState, every: int) -> None:
        self.accelerator = accelerator
        self.state = state
        self.every = every
        self.logged_through = 0  # state.step when metrics were last logged

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        steps = self.state.step  # steps finished before this forward; the newest is step steps - 1
        if steps == self.logged_through or steps % self.every:
            return
        self.logged_through = steps
        metrics = self.state.metrics()
        if metrics:
            self.accelerator.log(metrics, step=steps - 1)


class _EveryRankState:
    """What ``accelerator.save_state`` saves for flexcomm: every rank's state, in the main process's file.

    Accelerate calls ``state_dict`` on every rank (only the main process writes) and
    ``load_state_dict`` on every rank with the file's contents.
    """

    def __init__(self, state: flexcomm.FlexState) -> None:
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        rank_states = gather_rank_states(self.state)
        return {} if rank_states is None else {CHECKPOINT_KEY: rank_states}

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        if CHECKPOINT_KEY not in saved:
            raise ValueError("this Accelerate checkpoint holds no flexcomm hook states; was it saved without flexcomm.accelerate.register?")
        load_own_rank_state(self.state, saved[CHECKPOINT_KEY])
