"""Communication: collectives over a torch.distributed process group. No compression math."""

from flexcomm.comm.collectives import allgather, allreduce_sum, broadcast_from, rank, world_size

__all__ = ["allgather", "allreduce_sum", "broadcast_from", "rank", "world_size"]
