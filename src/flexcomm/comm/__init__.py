"""Communication over a torch.distributed process group: collectives, agreement, probes. No compression math."""

from flexcomm.comm import clock
from flexcomm.comm.agreement import PendingFloats, agree_on_config, allreduce_floats, allreduce_floats_async
from flexcomm.comm.collectives import allgather, allreduce_sum, broadcast_from, control_device
from flexcomm.comm.dispatch import Dispatcher, fail_halves, forward_to, run_halves
from flexcomm.comm.groups import own_group
from flexcomm.comm.probes import probe_collectives
from flexcomm.comm.streams import ExchangeStreams, exchange_context, future_devices, mark_ready, used_on_current_stream

__all__ = ["Dispatcher", "clock", "ExchangeStreams", "PendingFloats", "agree_on_config", "allgather", "allreduce_floats",
           "allreduce_floats_async", "allreduce_sum", "broadcast_from", "control_device", "exchange_context",
           "fail_halves", "forward_to", "future_devices", "mark_ready", "own_group", "probe_collectives", "run_halves",
           "used_on_current_stream"]
