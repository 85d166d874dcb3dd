"""flexcomm in Hugging Face Accelerate: ``state = flexcomm.accelerate.register(accelerator, model, ...)``.

Needs the optional extra: ``pip install flexcomm[accelerate]``.

Accelerate's ``DistributedDataParallelKwargs(comm_hook=...)`` knows only PyTorch's
built-in hooks (it accepts others silently and registers nothing), so flexcomm is
registered on the model that ``accelerator.prepare`` returned.  :func:`register` also
makes ``accelerator.save_state`` / ``load_state`` carry the hook state of every rank:
Accelerate writes registered objects from the main process only, so each rank's state is
gathered there, and on loading each rank takes its own entry.
"""

from __future__ import annotations

from typing import Any

from accelerate import Accelerator
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import flexcomm
from flexcomm.rank_states import CHECKPOINT_KEY, gather_rank_states, load_own_rank_state

__all__ = ["register"]


def register(accelerator: Accelerator, model: nn.Module, **state_args: Any) -> flexcomm.FlexState:
    """Register flexcomm's hook on ``model`` (as returned by ``accelerator.prepare``); return its state.

    ``state_args`` are :class:`flexcomm.FlexState`'s arguments (``compressor``, ``density``, ...).
    Call it after ``prepare`` and before ``load_state``, on every rank.
    """
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
    return state


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
