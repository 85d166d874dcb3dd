"""Simulated communication time per training step, for ``N`` ranks far beyond this machine.

Driven entirely by :mod:`flexcomm.cost.model`.  Gradients are bucketed like PyTorch DDP
(default ``bucket_cap_mb=25``, i.e. 25 MiB, with a first bucket of
``torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`` = 1 MiB); every bucket is exchanged
separately, so one step costs the sum over buckets.  DDP closes buckets at parameter
boundaries; without per-layer sizes the buckets here are cut at element granularity,
which is exact for the bandwidth terms and counts the same number of latency terms up to
one bucket.

The two-level model (:class:`Topology`) runs the standard hierarchical allreduce for
``g`` GPUs per node on ``n`` nodes and ``m`` bytes: ring reduce-scatter inside each node,
ring allreduce of the ``m / g``-byte shard across nodes (one GPU per node per shard, all
shards in parallel), ring allgather inside each node:

    t = 2 [(g-1) a_intra + (g-1)/g m b_intra] + 2(n-1) a_inter + 2(n-1)/n (m/g) b_inter.

With ``n = 1`` it is a ring allreduce on the intra-node link only, with ``g = 1`` a ring
allreduce on the inter-node link only.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from flexcomm.cost.model import (
    EXCHANGES,
    CostParams,
    Exchange,
    LinkParams,
    agtopk_time,
    allreduce_time,
    artopk_time,
    dense16_time,
    dense_time,
)

# Parameter counts from torchvision's weight metadata (``num_params`` of
# ResNet50_Weights.IMAGENET1K_V1, AlexNet_Weights.IMAGENET1K_V1 and
# ViT_B_16_Weights.IMAGENET1K_V1; pytorch.org/vision/stable/models.html).
MODEL_NUM_PARAMS: dict[str, int] = {
    "resnet50": 25_557_032,
    "alexnet": 61_100_840,
    "vit_b_16": 86_567_656,
}

DDP_BUCKET_CAP_BYTES = 25 * 1024 * 1024
DDP_FIRST_BUCKET_BYTES = 1024 * 1024

# Assumed links of the two-level model.  Intra-node: PCIe 3.0 x16 class, ~12 GB/s
# effective and 10 us per message (NVLink would be several times faster still, which only
# widens the gap).  Inter-node: 10 Gbit/s Ethernet with TCP, 50 us per message.
INTRA_NODE_LINK = LinkParams.from_bandwidth(10e-6, 12e9 * 8)
INTER_NODE_10GBPS = LinkParams.from_bandwidth(50e-6, 10e9)


def bucket_sizes(
    num_params: int,
    value_bytes: int = 4,
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
    first_bucket_bytes: int = DDP_FIRST_BUCKET_BYTES,
) -> list[int]:
    """Elements per bucket: the first holds ``min(first_bucket_bytes, bucket_cap_bytes)``, the rest ``bucket_cap_bytes``."""
    if num_params < 1 or value_bytes < 1:
        raise ValueError("num_params and value_bytes must be >= 1")
    first = max(1, min(first_bucket_bytes, bucket_cap_bytes) // value_bytes)
    cap = max(1, bucket_cap_bytes // value_bytes)
    sizes = [min(first, num_params)]
    remaining = num_params - sizes[0]
    while remaining > 0:
        sizes.append(min(cap, remaining))
        remaining -= sizes[-1]
    return sizes


def exchange_time(
    exchange: Exchange, numel: int, density: float, world_size: int, params: CostParams, value_bytes: int = 4
) -> float:
    """Predicted seconds of one bucket's ``exchange`` (``density`` is unused by ``dense``)."""
    if exchange == "dense":
        return dense_time(numel, world_size, params, value_bytes)
    if exchange == "dense16":
        return dense16_time(numel, world_size, params)
    if exchange == "agtopk":
        return agtopk_time(numel, density, world_size, params, value_bytes)
    if exchange == "artopk":
        return artopk_time(numel, density, world_size, params, value_bytes)
    raise ValueError(f"unknown exchange {exchange!r}; expected one of {EXCHANGES}")


def step_comm_time(
    num_params: int,
    world_size: int,
    params: CostParams,
    exchange: Exchange,
    density: float = 1.0,
    value_bytes: int = 4,
    bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES,
) -> float:
    """Seconds of one step's gradient exchange: the sum over DDP-like buckets."""
    buckets = bucket_sizes(num_params, value_bytes, bucket_cap_bytes)
    return sum(exchange_time(exchange, m, density, world_size, params, value_bytes) for m in buckets)


def comm_vs_world_size(
    models: Mapping[str, int],
    world_sizes: Iterable[int],
    exchanges: Iterable[Exchange],
    density: float,
    params: CostParams,
    value_bytes: int = 4,
) -> list[dict[str, object]]:
    """One row per (model, exchange, N): ``model, num_params, exchange, world_size, seconds``."""
    sizes = list(world_sizes)
    return [
        {
            "model": name,
            "num_params": count,
            "exchange": exchange,
            "world_size": n,
            "seconds": step_comm_time(count, n, params, exchange, density, value_bytes),
        }
        for name, count in models.items()
        for exchange in exchanges
        for n in sizes
    ]


@dataclass(frozen=True)
class Topology:
    """``nodes`` nodes with ``gpus_per_node`` GPUs each, joined by ``inter``; GPUs in a node by ``intra``."""

    nodes: int
    gpus_per_node: int
    intra: LinkParams = INTRA_NODE_LINK
    inter: LinkParams = INTER_NODE_10GBPS

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.gpus_per_node < 1:
            raise ValueError("nodes and gpus_per_node must be >= 1")

    @property
    def world_size(self) -> int:
        """Total number of ranks."""
        return self.nodes * self.gpus_per_node


def hierarchical_allreduce_time(nbytes: float, topology: Topology) -> float:
    """Two-level allreduce of ``nbytes`` (formula in the module docstring)."""
    g, intra = topology.gpus_per_node, topology.intra
    intra_phase = (g - 1) * intra.alpha + (g - 1) / g * nbytes * intra.beta
    return 2.0 * intra_phase + allreduce_time(nbytes / g, topology.nodes, topology.inter)


def step_dense_time_hierarchical(
    num_params: int, topology: Topology, value_bytes: int = 4, bucket_cap_bytes: int = DDP_BUCKET_CAP_BYTES
) -> float:
    """Seconds of one step's dense (DDP) allreduce on ``topology``, summed over buckets."""
    buckets = bucket_sizes(num_params, value_bytes, bucket_cap_bytes)
    return sum(hierarchical_allreduce_time(m * value_bytes, topology) for m in buckets)
