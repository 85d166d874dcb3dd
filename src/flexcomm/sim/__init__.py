"""Cluster simulator driven by the alpha-beta cost model (:mod:`.comm_time`: time per step at N ranks)."""

from flexcomm.sim.comm_time import (
    DDP_BUCKET_CAP_BYTES,
    DDP_FIRST_BUCKET_BYTES,
    INTER_NODE_10GBPS,
    INTRA_NODE_LINK,
    MODEL_NUM_PARAMS,
    Topology,
    bucket_sizes,
    comm_vs_world_size,
    exchange_time,
    hierarchical_allreduce_time,
    step_comm_time,
    step_dense_time_hierarchical,
)

__all__ = [
    "DDP_BUCKET_CAP_BYTES",
    "DDP_FIRST_BUCKET_BYTES",
    "INTER_NODE_10GBPS",
    "INTRA_NODE_LINK",
    "MODEL_NUM_PARAMS",
    "Topology",
    "bucket_sizes",
    "comm_vs_world_size",
    "exchange_time",
    "hierarchical_allreduce_time",
    "step_comm_time",
    "step_dense_time_hierarchical",
]
