"""Exchanges: the collectives that carry one bucket, and the leader policies of AR-Topk.

Each exchange is ``exchange(job) -> Future`` (see :class:`BucketJob`) and issues its
collectives through :mod:`flexcomm.comm` in a fixed order:

``dense``   one allreduce of the whole bucket (:mod:`~flexcomm.exchange.dense`);
``dense16`` one allreduce of the whole bucket in fp16 (:mod:`~flexcomm.exchange.dense16`);
``agtopk``  one allgather of every rank's (values, indices) (:mod:`~flexcomm.exchange.allgather`);
``artopk``  a broadcast of the leader's indices, then one allreduce of the values
            (:mod:`~flexcomm.exchange.artopk`);
``lowrank`` two allreduces of rank-r factors (:mod:`~flexcomm.exchange.lowrank`).
"""

from collections.abc import Callable

import torch

from flexcomm.cost.model import DENSE_EXCHANGES
from flexcomm.exchange.allgather import exchange_allgather
from flexcomm.exchange.artopk import exchange_artopk
from flexcomm.exchange.dense import exchange_dense
from flexcomm.exchange.dense16 import exchange_dense16
from flexcomm.exchange.job import BucketJob
from flexcomm.exchange.lowrank import exchange_lowrank
from flexcomm.exchange.leaders import LEADER_POLICIES, GradientStatistic, LeaderPolicy, RoundRobin, make_leader_policy

#: Exchange name (as the cost model names them) -> the function that runs it.
EXCHANGES: dict[str, Callable[[BucketJob], torch.futures.Future]] = {
    "dense": exchange_dense,
    "dense16": exchange_dense16,
    "agtopk": exchange_allgather,
    "artopk": exchange_artopk,
    "lowrank": exchange_lowrank,
}

__all__ = ["DENSE_EXCHANGES", "EXCHANGES", "LEADER_POLICIES", "BucketJob", "GradientStatistic", "LeaderPolicy", "RoundRobin", "make_leader_policy"]
