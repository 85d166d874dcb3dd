"""Alpha-beta cost model of the collectives and of the three gradient exchanges.

A point-to-point message of ``m`` bytes costs ``alpha + m * beta`` (latency ``alpha`` in
seconds, inverse bandwidth ``beta`` in seconds per byte).  Every collective below is
written as ``t = a(N) * alpha + b(N, m) * beta``: :func:`collective_coefficients` returns
``(a, b)``, so the same coefficients serve prediction (here) and least-squares fitting
(:mod:`flexcomm.cost.estimator`, :mod:`flexcomm.cost.link_fit`).  Formulas after Thakur, Rabenseifner & Gropp,
"Optimization of Collective Communication Operations in MPICH" (IJHPCA 2005);
``m`` is the message size in bytes, ``N`` the number of ranks, ``L = ceil(log2 N)``:

==========  ========================  ========  ==============
kind        algorithm                 a(N)      b(N, m)
==========  ========================  ========  ==============
allreduce   ``ring``                  2(N-1)    2(N-1)/N * m
allreduce   ``tree``                  2L        2L * m
allgather   ``ring``                  N-1       (N-1) * m
allgather   ``recursive_doubling``    L         (N-1) * m
broadcast   ``binomial``              L         L * m
broadcast   ``ring``                  N-1       m
==========  ========================  ========  ==============

For allgather ``m`` is what *each* rank contributes.  ``N = 1`` costs nothing.  The
``tree`` allreduce (reduce then broadcast along a binomial tree) and the recursive-doubling
allgather are the variants the paper's authors charge (``2 log2 N`` terms for a tree
AR-Topk); the pipelined ``ring`` broadcast is NCCL's (``b = m`` is its large-message
limit; its per-chunk latency is folded into ``alpha`` by the fit).

What the backends really run (checked against their sources):

* **gloo via PyTorch** (``torch/csrc/distributed/c10d/ProcessGroupGloo*.{cpp,hpp}``):
  ``AsyncAllreduceWork`` calls ``gloo::allreduce`` without choosing an algorithm, and
  ``gloo/allreduce.cc`` maps ``UNSPECIFIED`` to ``RING`` (``BCUBE``, i.e. recursive
  halving/doubling, only when a caller asks, which c10d does not), whatever the size: a
  ring reduce-scatter then a ring allgather, each rank's chunk cut into >= 2 segments so
  that one is in flight while the other is reduced.  ``AsyncAllgatherWork`` calls
  ``gloo::allgather`` (``gloo/allgather.cc``): a ring of ``N-1`` steps, each rank's block
  sent as two halves.  ``AsyncBroadcastWork`` calls ``gloo::broadcast``
  (``gloo/broadcast.cc``): a binomial tree, ``ceil(log2 N)`` rounds forwarding the whole
  message.  gloo's separate algorithm classes (ring-chunked, halving-doubling, bcube) are
  chosen by caffe2's gloo operators, not by c10d.  Hence :data:`GLOO_ALGORITHMS` = ring
  allreduce, ring allgather, binomial broadcast.  The segmenting gives small messages up
  to about twice the ``a(N)`` latency terms; the online fit absorbs that into ``alpha``,
  one more reason to fit ``(alpha, beta)`` per collective kind.
* **NCCL** picks, per call, the (algorithm, protocol) pair its internal tuning model
  predicts fastest for the message size (maintainer's description in NVIDIA/nccl issue
  #457; ``NCCL_ALGO`` restricts the set).  Allreduce: ring, (double binary) tree,
  CollNet, NVLS; allgather: ring, plus PAT / NVLS / CollNet where available
  (``src/device/all_gather.h``); broadcast: ring only, a pipelined chain
  (``src/device/broadcast.h``).  Small NCCL allreduces are therefore tree-like (use
  :data:`TREE_ALGORITHMS` style coefficients), large ones ring.

The four exchanges of one bucket of ``M`` elements at density ``c``
(``k = max(1, ceil(c * M))``, at most ``M``; ``vb`` value bytes, 4-byte int32 indices):

* ``dense``:  ``allreduce(M * vb)``
* ``dense16``: ``allreduce(M * 2)`` (the bucket in fp16, whatever ``vb``)
* ``agtopk``: ``allgather(k * (vb + 4))`` (values and indices packed in one message)
* ``artopk``: ``broadcast(k * 4) + allreduce(k * vb)``
* ``lowrank``: ``allreduce(4 * first) + allreduce(4 * second)`` (:func:`lowrank_time`: its
  payload follows the bucket's matrices, not the density, so it is not in :data:`EXCHANGES`)

Only communication is modelled; the cost of selecting the top-k is the controller's.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from flexcomm.compress.sparse import INDEX_BYTES
from flexcomm.compress.topk import k_for

CollectiveKind = Literal["allreduce", "allgather", "broadcast"]
Exchange = Literal["dense", "dense16", "artopk", "agtopk"]

KINDS: tuple[CollectiveKind, ...] = ("allreduce", "allgather", "broadcast")
#: Tie-break order of :func:`cheapest_exchange`: on equal predicted time the earlier wins
#: (dense needs no compression work, dense16 no selection; AR-Topk keeps one index set for every rank).
EXCHANGES: tuple[Exchange, ...] = ("dense", "dense16", "artopk", "agtopk")
#: The exchanges that send every element (no selection; the bucket is compensated in place).
DENSE_EXCHANGES: frozenset[Exchange] = frozenset({"dense", "dense16"})
#: Bytes per value of ``dense16``'s allreduce.
HALF_BYTES = 2
#: Bytes per value of the low-rank exchange's factors (fp32 whatever the gradient's dtype).
FACTOR_BYTES = 4

ALGORITHMS: dict[CollectiveKind, tuple[str, ...]] = {
    "allreduce": ("ring", "tree"),
    "allgather": ("ring", "recursive_doubling"),
    "broadcast": ("binomial", "ring"),
}


def _check_kind(kind: str) -> str:
    if kind not in KINDS:
        raise ValueError(f"unknown collective kind {kind!r}; expected one of {KINDS}")
    return kind


def validate_algorithm(kind: str, algorithm: str) -> None:
    """Raise ``ValueError`` unless ``algorithm`` is one of :data:`ALGORITHMS` for ``kind``."""
    _check_kind(kind)
    if algorithm not in ALGORITHMS[kind]:
        raise ValueError(f"unknown {kind} algorithm {algorithm!r}; expected one of {ALGORITHMS[kind]}")


@dataclass(frozen=True)
class LinkParams:
    """Latency ``alpha`` (s) and inverse bandwidth ``beta`` (s/byte) of one link model."""

    alpha: float
    beta: float

    def __post_init__(self) -> None:
        if not (self.alpha >= 0.0 and self.beta >= 0.0):
            raise ValueError(f"alpha and beta must be >= 0, got {self.alpha}, {self.beta}")

    @classmethod
    def from_bandwidth(cls, alpha: float, bits_per_second: float) -> LinkParams:
        """Link with latency ``alpha`` and a bandwidth in bit/s: ``beta = 8 / bandwidth``."""
        if bits_per_second <= 0.0:
            raise ValueError(f"bandwidth must be > 0, got {bits_per_second}")
        return cls(alpha, 8.0 / bits_per_second)


@dataclass(frozen=True)
class Algorithms:
    """Which algorithm each collective kind runs (see the module docstring)."""

    allreduce: str = "ring"
    allgather: str = "ring"
    broadcast: str = "binomial"

    def __post_init__(self) -> None:
        for kind in KINDS:
            validate_algorithm(kind, getattr(self, kind))

    def of(self, kind: CollectiveKind) -> str:
        """Algorithm used for ``kind``."""
        return getattr(self, _check_kind(kind))


#: What PyTorch's gloo backend runs (ring allreduce, ring allgather, binomial broadcast).
GLOO_ALGORITHMS = Algorithms()
#: The paper authors' model: tree allreduce, recursive-doubling allgather, binomial broadcast.
TREE_ALGORITHMS = Algorithms(allreduce="tree", allgather="recursive_doubling")


@dataclass(frozen=True)
class CostParams:
    """Link parameters per collective kind plus the algorithm each kind runs.

    On this machine gloo's allgather moves the same bytes ~1.5x slower than its allreduce,
    so each kind has its own ``(alpha, beta)``.
    """

    allreduce: LinkParams
    allgather: LinkParams
    broadcast: LinkParams
    algorithms: Algorithms = field(default=GLOO_ALGORITHMS)

    @classmethod
    def uniform(cls, link: LinkParams, algorithms: Algorithms = GLOO_ALGORITHMS) -> CostParams:
        """The same link parameters for every collective kind."""
        return cls(link, link, link, algorithms)

    def link(self, kind: CollectiveKind) -> LinkParams:
        """Link parameters fitted for ``kind``."""
        return getattr(self, _check_kind(kind))


def ceil_log2(n: int) -> int:
    """``ceil(log2 n)`` for ``n >= 1``, exact for integers (0 for ``n = 1``)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    return (n - 1).bit_length()


def collective_coefficients(
    kind: CollectiveKind, algorithm: str, nbytes: float, world_size: int
) -> tuple[float, float]:
    """``(a, b)`` with ``time = a * alpha + b * beta`` for one collective (module table)."""
    validate_algorithm(kind, algorithm)
    if world_size < 1 or nbytes < 0:
        raise ValueError(f"need world_size >= 1 and nbytes >= 0, got {world_size}, {nbytes}")
    n = world_size
    if n == 1:
        return 0.0, 0.0
    steps = ceil_log2(n)
    if kind == "allreduce":
        if algorithm == "ring":
            return 2.0 * (n - 1), 2.0 * (n - 1) / n * nbytes
        return 2.0 * steps, 2.0 * steps * nbytes
    if kind == "allgather":
        latency_terms = n - 1 if algorithm == "ring" else steps
        return float(latency_terms), (n - 1) * nbytes
    if algorithm == "binomial":
        return float(steps), steps * nbytes
    return float(n - 1), float(nbytes)


def collective_time(kind: CollectiveKind, nbytes: float, world_size: int, params: CostParams) -> float:
    """Predicted seconds of one ``kind`` collective of ``nbytes`` under ``params``."""
    a, b = collective_coefficients(kind, params.algorithms.of(kind), nbytes, world_size)
    link = params.link(kind)
    return a * link.alpha + b * link.beta


#: A probe times one message per collective kind and size; a larger size is cut down to what the
#: kind's last timed message says transfers in about this long (see :func:`probe_size`).
PROBE_MESSAGE_SECONDS = 0.025


def probe_size(size: int, last: tuple[int, float] | None, latency: float) -> int:
    """The bytes a probe really times for configured ``size``, given the kind's last timed ``(bytes, seconds)``
    and ``latency``, the seconds of a one-float allreduce.

    The last message's transfer time (its time less ``latency``), scaled by bytes, predicts the
    transfer at ``size``.  Where that is over :data:`PROBE_MESSAGE_SECONDS`, ``size`` is cut to
    the bytes predicted to transfer in that long, but at least twice the last message (two sizes
    far enough apart to tell latency from bandwidth).  A last message that spent more time on
    latency than on transfer says too little about the rate to cut anything.  On a fast link
    nothing is cut; at 20 Mbit/s the default 1 MiB message (0.4 s per kind) becomes 128 KiB.
    """
    if last is None:
        return size
    last_bytes, last_seconds = last
    transfer = last_seconds - latency
    if transfer <= latency or transfer * size <= PROBE_MESSAGE_SECONDS * last_bytes:
        return size
    fitting = int(last_bytes * PROBE_MESSAGE_SECONDS / transfer) // 4 * 4
    return min(size, max(2 * last_bytes, fitting))


def link_bound(last: dict[CollectiveKind, tuple[int, float]], latency: float, world_size: int,
               algorithms: Algorithms) -> dict[CollectiveKind, tuple[int, float]]:
    """Each kind's last ``(bytes, seconds)``, its seconds raised to the kinds' median link rate where that is slower.

    The kinds share one link, but a shaped link passes a message that fits its token bucket at
    line speed, so the kind probed first at a size can read many times the link's rate and its
    next size would go uncut: at 20 Mbit/s a 64 KiB allreduce read 0.7 ms, so the 1 MiB one was
    timed whole and took 0.44 s, where the allgather's 64 KiB, sent after it, had read 24 ms.
    The median, not the slowest: on a fast link one kind's small message slowed by the host
    (3-4 ms for 64 KiB at 1 Gbit/s) would otherwise cut every kind to a few hundred KB, messages
    too small to fit the rate (the dense allreduce was then predicted at 2-6x its time).
    A rate is a message's transfer (its seconds less ``latency``) per unit of its bandwidth
    coefficient ``b`` (:func:`collective_coefficients`); a message that spent more time on latency
    than on transfer gives none (see :func:`probe_size`).
    """
    units = {kind: collective_coefficients(kind, algorithms.of(kind), nbytes, world_size)[1]
             for kind, (nbytes, _) in last.items()}
    rates = [(seconds - latency) / units[kind] for kind, (_, seconds) in last.items()
             if seconds - latency > latency and units[kind] > 0.0]
    if not rates:
        return dict(last)
    rate = statistics.median(rates)
    return {kind: (nbytes, max(seconds, latency + rate * units[kind])) for kind, (nbytes, seconds) in last.items()}


def predicted_probe(sizes: Sequence[int], world_size: int, params: CostParams) -> list[tuple[CollectiveKind, int, float]]:
    """``(kind, bytes, seconds)`` of every message of one probe under ``params``, in the probe's order:
    ``sizes`` ascending, every kind at each, each cut by :func:`probe_size` on the predicted times
    raised to the kinds' median rate (:func:`link_bound`), as the probe cuts them."""
    latency = collective_time("allreduce", 4, world_size, params)
    messages: list[tuple[CollectiveKind, int, float]] = []
    last: dict[CollectiveKind, tuple[int, float]] = {}
    for size in sorted(set(sizes)):
        bound = link_bound(last, latency, world_size, params.algorithms)
        for kind in KINDS:
            nbytes = probe_size(size, bound.get(kind), latency)
            last[kind] = (nbytes, collective_time(kind, nbytes, world_size, params))
            messages.append((kind, *last[kind]))
    return messages


def probe_time(sizes: Sequence[int], world_size: int, params: CostParams) -> float:
    """Predicted seconds of one probe: a one-float allreduce (the latency), then :func:`predicted_probe`'s messages."""
    latency = collective_time("allreduce", 4, world_size, params)
    return latency + sum(seconds for _, _, seconds in predicted_probe(sizes, world_size, params))


def allreduce_time(nbytes: float, world_size: int, link: LinkParams, algorithm: str = "ring") -> float:
    """Allreduce of ``nbytes``: ring ``2(N-1)a + 2(N-1)/N m b``; tree ``2L(a + m b)``."""
    a, b = collective_coefficients("allreduce", algorithm, nbytes, world_size)
    return a * link.alpha + b * link.beta


def allgather_time(nbytes: float, world_size: int, link: LinkParams, algorithm: str = "ring") -> float:
    """Allgather of ``nbytes`` per rank: ring ``(N-1)(a + m b)``; recursive doubling ``L a + (N-1) m b``."""
    a, b = collective_coefficients("allgather", algorithm, nbytes, world_size)
    return a * link.alpha + b * link.beta


def broadcast_time(nbytes: float, world_size: int, link: LinkParams, algorithm: str = "binomial") -> float:
    """Broadcast of ``nbytes``: binomial tree ``L(a + m b)``; pipelined ring ``(N-1) a + m b``."""
    a, b = collective_coefficients("broadcast", algorithm, nbytes, world_size)
    return a * link.alpha + b * link.beta


def dense_time(numel: int, world_size: int, params: CostParams, value_bytes: int = 4) -> float:
    """DenseSGD: ``allreduce(M * vb)``."""
    return collective_time("allreduce", numel * value_bytes, world_size, params)


def dense16_time(numel: int, world_size: int, params: CostParams) -> float:
    """Dense16: ``allreduce(M * 2)``."""
    return collective_time("allreduce", numel * HALF_BYTES, world_size, params)


def agtopk_time(numel: int, density: float, world_size: int, params: CostParams, value_bytes: int = 4) -> float:
    """AG-Topk: ``allgather(k * (vb + 4))``, one packed message per rank."""
    k = k_for(numel, density)
    return collective_time("allgather", k * (value_bytes + INDEX_BYTES), world_size, params)


def artopk_time(numel: int, density: float, world_size: int, params: CostParams, value_bytes: int = 4) -> float:
    """AR-Topk: ``broadcast(k * 4) + allreduce(k * vb)``."""
    k = k_for(numel, density)
    indices = collective_time("broadcast", k * INDEX_BYTES, world_size, params)
    return indices + collective_time("allreduce", k * value_bytes, world_size, params)


def lowrank_time(first_numel: int, second_numel: int, world_size: int, params: CostParams) -> float:
    """Low-rank: ``allreduce(4 * first) + allreduce(4 * second)``: the P factors with the parameters
    sent whole, then the Q factors (fp32; see :mod:`flexcomm.exchange.lowrank`)."""
    return (collective_time("allreduce", first_numel * FACTOR_BYTES, world_size, params)
            + collective_time("allreduce", second_numel * FACTOR_BYTES, world_size, params))


def predict_exchange_times(
    numel: int, density: float, world_size: int, params: CostParams, value_bytes: int = 4
) -> dict[Exchange, float]:
    """Predicted seconds of each exchange for one bucket, keyed in :data:`EXCHANGES` order."""
    return {
        "dense": dense_time(numel, world_size, params, value_bytes),
        "dense16": dense16_time(numel, world_size, params),
        "artopk": artopk_time(numel, density, world_size, params, value_bytes),
        "agtopk": agtopk_time(numel, density, world_size, params, value_bytes),
    }


def cheapest_exchange(
    numel: int,
    density: float,
    world_size: int,
    params: CostParams,
    value_bytes: int = 4,
    candidates: Sequence[Exchange] = EXCHANGES,
) -> Exchange:
    """The exchange with the smallest predicted time among ``candidates``.

    Deterministic: exact float comparison, and on a tie the candidate that comes first in
    :data:`EXCHANGES` (dense, dense16, artopk, agtopk) wins, whatever order
    ``candidates`` lists them in.
    """
    unknown = set(candidates) - set(EXCHANGES)
    if unknown or not candidates:
        raise ValueError(f"candidates must be a non-empty subset of {EXCHANGES}, got {candidates}")
    times = predict_exchange_times(numel, density, world_size, params, value_bytes)
    ordered = [name for name in EXCHANGES if name in candidates]
    return min(ordered, key=lambda name: (times[name], EXCHANGES.index(name)))
