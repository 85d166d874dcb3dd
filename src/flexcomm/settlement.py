"""Settling a state's exchanges: what they measured, fed back to the records, planner, leaders and memory.

An exchange reports two kinds of results.  Host-side timings arrive as it runs and go to
the planner at once (:meth:`Settlement.measured`).  Device-side outcomes (the sent gain,
the low-rank quality, whether the result is finite, the leader statistics, and on a GPU
the CUDA-event times) stay on the device until :meth:`Settlement.settle` reads all pending
ones in one transfer.  :class:`~flexcomm.state.FlexState` owns one settlement and settles
it at each step's first bucket and whenever its records or checkpoint state are read.
"""

from __future__ import annotations

import threading

import torch
import torch.distributed as dist

from flexcomm.compress import ResidualMemory
from flexcomm.compress.stats import to_host
from flexcomm.control import StepPlanner
from flexcomm.cost import Observation
from flexcomm.exchange import LeaderPolicy
from flexcomm.exchange.job import BucketRecord, DeviceOutcome, apply_timings


class Settlement:
    """The exchanges' results not yet fed back, and feeding them back.

    Args:
        planner: takes the exchanges' timings, sent gains and low-rank qualities.
        memory: adopts (or drops) its new residuals once their condition is read.
        leaders: AR-Topk's leader policy, fed the statistics of finite exchanges (None: none).
        process_group: the group the exchanges ran over (``None``: the default group).
    """

    def __init__(
        self, planner: StepPlanner, memory: ResidualMemory, leaders: LeaderPolicy | None,
        process_group: dist.ProcessGroup | None,
    ) -> None:
        self.planner = planner
        self.memory = memory
        self.leaders = leaders
        self.process_group = process_group
        # Records whose device-side outcome is not read yet (see settle()).
        self._unsettled: list[tuple[BucketRecord, DeviceOutcome]] = []
        self._lock = threading.Lock()

    def expect(self, record: BucketRecord, outcome: DeviceOutcome) -> None:
        """Note a bucket's record whose device-side ``outcome`` its exchange will fill."""
        self._unsettled.append((record, outcome))

    def measured(self, record: BucketRecord, kind: str, nbytes: int, seconds: float) -> None:
        """Feed the planner one timed collective of ``record``'s exchange (the exchanges' timing callback)."""
        t_compress = None if record.exchange == "dense" else record.t_compress
        world_size = dist.get_world_size(self.process_group)
        self.planner.observe_exchange(record.step, record.bucket, Observation(kind, nbytes, world_size, seconds), t_compress)

    def settle(self) -> None:
        """Read the finished buckets' device-side outcomes in one transfer and apply them.

        Fills the records' ``gain`` and ``finite`` (and, on a GPU, their times from CUDA
        events, reporting the network samples), feeds the leader policy the statistics
        of finite exchanges, and lets the memory adopt (or drop) the new residuals.  Only
        buckets whose exchange finished may be pending.
        """
        with self._lock:
            unsettled, self._unsettled = self._unsettled, []
            for rec, out in unsettled:
                if out.timings is not None:
                    apply_timings(rec, out.timings, self.measured)
            conditions = self.memory.pending()
            tensors: list[torch.Tensor] = list(conditions.values())
            fields = [(rec, name, value) for rec, out in unsettled
                      for name, value in (("gain", out.gain), ("quality", out.quality), ("finite", out.finite),
                                          ("statistics", out.statistics))
                      if value is not None]
            tensors += [value for _, _, value in fields]
            host = to_host(tensors)
            self.memory.settle({index: bool(v[0]) for index, v in zip(conditions, host)})
            for (rec, name, _), values in zip(fields, host[len(conditions):]):
                if name == "gain":
                    rec.gain = values[0]
                    self.planner.observe_sent(rec.step, rec.bucket, rec.gain)
                elif name == "quality":
                    rec.quality = values[0]
                    self.planner.observe_quality(rec.step, rec.bucket, rec.quality)
                elif name == "finite":
                    rec.finite = bool(values[0])
                elif rec.finite and self.leaders is not None:
                    self.leaders.observe(rec.bucket, values)
