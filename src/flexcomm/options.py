"""The compressor table and the validated options of a :class:`~flexcomm.FlexState`.

One table (:data:`COMPRESSOR_TABLE`) maps every compressor name to its roles:

=============  ==========  ==============  =========================================
compressor     selector    leader policy   exchange
=============  ==========  ==============  =========================================
``dense``      --          --              ``dense``: allreduce of ``a_i``
``agtopk``     ``topk``    --              ``agtopk``: allgather of (values, indices)
``mstopk``     ``mstopk``  --              ``agtopk``
``artopk-star``  ``topk``  ``round-robin``  ``artopk``: broadcast indices, allreduce values
``artopk-var``   ``topk``  ``statistic``    ``artopk``
``lowrank``    --          --              ``lowrank``: allreduce of rank-r factors (PowerSGD)
``flex``       ``topk``    ``round-robin``  per bucket: ``dense``, ``dense16``, ``agtopk``, ``artopk``, ``lowrank``
=============  ==========  ==============  =========================================

STAR and VAR differ only by the leader policy, MSTopk and AG-Topk only by the selector.
``lowrank`` sends ``rank``-r factors of each matrix-shaped gradient instead of a density's
share of its elements (:mod:`flexcomm.compress.lowrank`): ``density`` does not apply to it.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexcomm.compress.lowrank import DEFAULT_RANK
from flexcomm.compress.mstopk import DEFAULT_ROUNDS
from flexcomm.exchange.leaders import STATISTICS
from flexcomm.validation import check_choice, check_fraction, check_int


@dataclass(frozen=True)
class Compressor:
    """A compressor's roles: selector, leader policy, exchange (``None``: not used / chosen per bucket)."""

    selector: str | None
    leader: str | None
    exchange: str | None


COMPRESSOR_TABLE: dict[str, Compressor] = {
    "dense": Compressor(selector=None, leader=None, exchange="dense"),
    "agtopk": Compressor(selector="topk", leader=None, exchange="agtopk"),
    "mstopk": Compressor(selector="mstopk", leader=None, exchange="agtopk"),
    "artopk-star": Compressor(selector="topk", leader="round-robin", exchange="artopk"),
    "artopk-var": Compressor(selector="topk", leader="statistic", exchange="artopk"),
    "lowrank": Compressor(selector=None, leader=None, exchange="lowrank"),
    "flex": Compressor(selector="topk", leader="round-robin", exchange=None),
}
COMPRESSORS = tuple(COMPRESSOR_TABLE)
VAR_STATISTICS = STATISTICS


@dataclass(frozen=True)
class FlexOptions:
    """The validated settings of a :class:`FlexState` (see its docstring for each)."""

    compressor: str = "artopk-star"
    density: float | str = 0.01
    warmup_steps: int = 0
    mstopk_rounds: int = DEFAULT_ROUNDS
    var_statistic: str = "norm"
    var_smoothing: float = 0.9
    flex_interval: int = 10
    probe_every: int = 200
    probe_sizes: tuple[int, ...] = (65536, 1 << 20)
    forgetting: float = 0.9
    max_records: int = 100_000
    dense16: bool = True
    rank: int = DEFAULT_RANK
    lowrank: bool = True

    def __post_init__(self) -> None:
        check_choice("compressor", self.compressor, COMPRESSORS)
        if self.compressor == "lowrank" and self.density == "auto":
            raise ValueError("density='auto' chooses a top-k density; compressor='lowrank' sends rank-r factors "
                             "(set rank=, or use compressor='flex' with density='auto')")
        if self.density != "auto":
            check_fraction("density", self.density, low_open=True, high_open=False, extra=" or 'auto'")
        for name, minimum in (("warmup_steps", 0), ("mstopk_rounds", 1), ("flex_interval", 1), ("probe_every", 1),
                              ("max_records", 1), ("rank", 1)):
            check_int(name, getattr(self, name), minimum)
        check_choice("var_statistic", self.var_statistic, VAR_STATISTICS)
        check_fraction("var_smoothing", self.var_smoothing, low_open=False, high_open=True)
        sizes = self.probe_sizes
        if not sizes or any(isinstance(b, bool) or not isinstance(b, int) or b < 4 for b in sizes):
            raise ValueError(f"probe_sizes must be a non-empty sequence of ints >= 4 (bytes), got {sizes!r}")
        object.__setattr__(self, "probe_sizes", tuple(sizes))
        check_fraction("forgetting", self.forgetting, low_open=True, high_open=False)
        for name in ("dense16", "lowrank"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be True or False, got {getattr(self, name)!r}")

    @property
    def roles(self) -> Compressor:
        return COMPRESSOR_TABLE[self.compressor]
