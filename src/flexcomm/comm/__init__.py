"""Communication: collectives over a torch.distributed process group. No compression math."""

from flexcomm.comm.collectives import allgather, allreduce_sum, broadcast_from
from flexcomm.comm.timing import agree_on_config, agree_on_times, probe_collectives

__all__ = ["agree_on_config", "agree_on_times", "allgather", "allreduce_sum", "broadcast_from", "probe_collectives"]
