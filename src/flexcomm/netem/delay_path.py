"""A cluster's delay path: the kernel's ``netem`` qdiscs where they exist, else the delay switch.

The path delays what each host *sends* by that host's one-way delay (and jitter), and can
change it while a job runs.  :func:`choose_backend` picks the path (or none) for a
cluster; :class:`DelayPath` builds it into the cluster's :class:`~.topology.Topology` and
applies each change, through netem on the host links or through the user-space
:class:`~.delay_control.DelaySwitch` that replaces the kernel bridge.
"""

from __future__ import annotations

from collections.abc import Sequence

from .commands import NetemUnavailable
from .delay_control import DelaySwitch
from .schedule import Phase
from .topology import Topology

__all__ = ["DELAY_BACKENDS", "DelayPath", "check_delay", "choose_backend"]

#: Values of EmulatedCluster(delay_backend=...).
DELAY_BACKENDS = ("auto", "netem", "switch")
#: Smallest tbf burst with the delay switch: a whole 64 KiB GSO packet (plus the per-segment
#: headers tbf counts) must fit, or tbf cuts it into ~45 MTU-sized frames that the switch
#: forwards one by one (at 100 Mbit/s: ~20k frames/s, ~35% of a core, instead of ~200, ~3%).
SWITCH_MIN_BURST = 80_000


def check_delay(delay_s: float, jitter_s: float) -> None:
    """ValueError unless both are numbers of seconds in [0, 3600]."""
    for name, value in (("delay_s", delay_s), ("jitter_s", jitter_s)):
        if not (isinstance(value, (int, float)) and 0 <= value <= 3600):
            raise ValueError(f"{name} must be a number of seconds in [0, 3600], got {value!r}")


def choose_backend(net: Topology, phases: Sequence[Phase], wants: bool | None, request: str) -> str | None:
    """Which delay path to build, if any (namespaces must exist: netem is probed in one).

    ``wants`` and ``request`` are the cluster's ``delay=`` and ``delay_backend=``.
    """
    if wants is None:
        wants = any(p.delay_s > 0 or p.jitter_s > 0 for p in phases)
    if not wants:
        return None
    if request == "switch":
        return "switch"
    if net.netem_supported():
        return "netem"
    if request == "netem":
        raise NetemUnavailable("delay_backend='netem' but this kernel has no netem qdisc; use 'auto' or 'switch'")
    return "switch"


class DelayPath:
    """The delay path of ``net`` (``backend`` ``"netem"`` or ``"switch"``), built at ``first``'s delay and jitter.

    Building raises the hosts' TCP buffer limits to at least ``tcp_buffer_max`` bytes (0 = leave),
    so a window can cover bandwidth x round trip; ``switch_priority`` is the switch process's
    SCHED_FIFO priority (0 = normal scheduling).
    """

    def __init__(self, net: Topology, backend: str, first: Phase, switch_priority: int, tcp_buffer_max: int) -> None:
        self.backend = backend
        self._net = net
        #: The running delay switch (backend ``"switch"``), else None.
        self.switch: DelaySwitch | None = None
        net.raise_tcp_buffers(tcp_buffer_max)
        if backend == "netem":
            for i in range(net.n_hosts):
                net.set_netem_delay(i, first.delay_s, first.jitter_s, add=True)
        else:
            net.min_burst = SWITCH_MIN_BURST
            self.switch = DelaySwitch(net.ip, net.bridge_netns, net.port_if, first.delay_s, first.jitter_s,
                                      switch_priority)  # fmt: skip

    def set_delay(self, host: int | None, delay_s: float, jitter_s: float) -> None:
        """Delay what host ``host`` (None: every host) sends by ``delay_s`` with ``jitter_s``."""
        check_delay(delay_s, jitter_s)
        if self.switch is not None:
            self.switch.set_delay(host, delay_s, jitter_s)
        else:
            for i in range(self._net.n_hosts) if host is None else [host]:
                self._net.set_netem_delay(i, delay_s, jitter_s)
