"""Emulated hosts: one network namespace per rank, joined by a shaped bridge.

:class:`EmulatedCluster` composes the parts: :mod:`.topology` (namespaces, veths, bridge,
qdiscs), a delay path (:mod:`.delay_path`: the kernel's ``netem`` where it exists, else the
user-space switch of :mod:`.delay_control`), :mod:`.cleanup` (signals, atexit, stale
namespaces) and a :class:`~flexcomm.netem.runner.ScheduleRunner` that walks the schedule
while a job runs.

Delay (one-way, per host link, changeable while a job runs, optional jitter) applies to
what each host *sends*: A -> B sees A's delay, a round trip A -> B -> A sees A's plus B's.
A delay path is built when some phase has a delay or jitter, or with ``delay=True``; the
hosts' TCP buffer limits are then raised so a window can cover bandwidth x round trip.
"""

from __future__ import annotations

import logging
import os
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from flexcomm.launch import stop_processes

from . import cleanup
from .commands import absolute_program, require_netem, tool_path
from .delay_control import DelaySwitch
from .delay_path import DELAY_BACKENDS, DelayPath, check_delay, choose_backend
from .runner import RateChange, ScheduleRunner
from .schedule import Phase, describe_phases, parse_schedule
from .topology import MAX_HOSTS, Topology

__all__ = ["EmulatedCluster", "DELAY_BACKENDS"]

log = logging.getLogger("flexcomm.netem")

#: Set for every emulated host: NCCL then talks over sockets, through the shaped link.
NCCL_SOCKETS_ONLY = ("NCCL_P2P_DISABLE=1", "NCCL_SHM_DISABLE=1", "NCCL_IB_DISABLE=1")


class EmulatedCluster:
    """``n_hosts`` emulated machines with shaped links, as a context manager.

    Example (or let :func:`flexcomm.launch.run_ranks` start the ranks)::

        with EmulatedCluster(2, "1gbit:30s,100mbit") as cluster, cluster.start_schedule():
            for p in [cluster.popen(i, [sys.executable, "train.py", str(i)]) for i in range(2)]:
                p.wait()

    Args:
        n_hosts: number of hosts (1..254); host i is ``10.99.0.(i+1)``.
        schedule: a schedule string (see :mod:`flexcomm.netem.schedule`) or parsed phases.
            The first phase's rate is applied when the cluster starts; ``"none"`` leaves
            links unshaped (``set_rate`` still works).
        prefix: 1-8 letters starting every namespace and interface name; names also carry
            the pid (and a per-process counter for namespaces) so concurrent clusters never
            clash and :func:`cleanup_stale` can tell live runs from dead ones.
        delay: build a delay path? ``None`` (default): only if some phase of the schedule
            has a delay or jitter; ``True``: always, so :meth:`set_delay` works on a
            schedule without delay (and a 0 ms baseline goes through the same path);
            ``False``: never (requested delays are then only logged).
        delay_backend: ``"auto"`` (netem if the kernel has it, else the user-space
            switch), ``"netem"`` (fail without it) or ``"switch"``.
        switch_priority: SCHED_FIFO priority of the switch process (1-99), so its timers
            fire on time on a busy machine; 0 = normal scheduling.
        tcp_buffer_max: with a delay path, raise the maximum of the hosts'
            ``tcp_rmem``/``tcp_wmem`` to at least this many bytes (0 = leave).

    Raises:
        NetemUnavailable: on ``start()``/``__enter__`` without root or without
            ``ip``/``tc`` or working namespaces.
        ValueError: bad arguments, or names that would exceed 15 characters.
    """

    def __init__(
        self,
        n_hosts: int,
        schedule: str | Sequence[Phase] | None = "none",
        prefix: str = "fc",
        *,
        delay: bool | None = None,
        delay_backend: str = "auto",
        switch_priority: int = 10,
        tcp_buffer_max: int = 64 << 20,
    ) -> None:
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts must be in 1..{MAX_HOSTS}, got {n_hosts}")
        cleanup.check_prefix(prefix)
        if delay_backend not in DELAY_BACKENDS:
            raise ValueError(f"delay_backend must be one of {DELAY_BACKENDS}, got {delay_backend!r}")
        if not 0 <= switch_priority <= 99:
            raise ValueError(f"switch_priority must be in 0..99, got {switch_priority!r}")
        self.n_hosts = n_hosts
        self.prefix = prefix
        self.phases: list[Phase] = parse_schedule(schedule) if isinstance(schedule, str) or schedule is None else list(schedule)
        for p in self.phases:
            check_delay(p.delay_s, p.jitter_s)
        self._net = Topology(n_hosts, prefix, cleanup.next_cluster_seq())
        self.tag = self._net.tag
        self.bridge_netns = self._net.bridge_netns
        self.rate_bps: float | None = None
        #: Delay/jitter last applied to every host (per-host values: :meth:`host_delay`).
        self.delay_s = 0.0
        self.jitter_s = 0.0
        #: True once a delay path (netem or the switch) is in place.
        self.delay_emulated = False
        #: ``"netem"``, ``"switch"`` or None (no delay path); set by ``start``.
        self.delay_backend: str | None = None
        self._want_delay = delay
        self._backend_request = delay_backend
        self._switch_priority = switch_priority
        self._tcp_buffer_max = tcp_buffer_max
        self._host_delays = [(0.0, 0.0)] * n_hosts
        self._delay: DelayPath | None = None
        self._procs: list[subprocess.Popen[Any]] = []
        self._runners: list[ScheduleRunner] = []
        self._lock = threading.RLock()
        self._started = False
        self._closed = False
        self._env = ""

    # -- naming / addressing -------------------------------------------------
    @property
    def namespaces(self) -> list[str]:
        """Every namespace name of this cluster (bridge first)."""
        return self._net.namespaces

    def _check_host(self, i: int) -> None:
        if not 0 <= i < self.n_hosts:
            raise IndexError(f"host index {i} out of range 0..{self.n_hosts - 1}")

    def host_addr(self, i: int) -> str:
        """IPv4 address of host ``i`` (``10.99.0.(i+1)``), valid inside the cluster only."""
        self._check_host(i)
        return self._net.host_addr(i)

    def host_netns(self, i: int) -> str:
        """Network namespace name of host ``i``."""
        self._check_host(i)
        return self._net.host_netns[i]

    def host_ifname(self, i: int) -> str:
        """Interface of host ``i`` (what ``GLOO_SOCKET_IFNAME`` is set to)."""
        self._check_host(i)
        return self._net.host_if[i]

    def bridge_port(self, i: int) -> str:
        """Bridge-side veth of host ``i``; its qdisc limits traffic *to* host ``i``."""
        self._check_host(i)
        return self._net.port_if[i]

    def links(self) -> list[tuple[str, str]]:
        """``(namespace, device)`` of every shaped interface: host sides, then bridge ports."""
        return self._net.links()

    # -- lifecycle -------------------------------------------------------------
    def __enter__(self) -> EmulatedCluster:
        return self.start()

    def __exit__(self, exc_type: object, exc: object, tb: object) -> None:
        # Never mask the exception that is unwinding the with-block.
        self.close(raise_errors=exc_type is None)

    def start(self) -> EmulatedCluster:
        """Create namespaces, veths, bridge, addresses and qdiscs; returns self."""
        with self._lock:
            if self._started:
                raise RuntimeError("EmulatedCluster already started")
            if self._closed:
                raise RuntimeError("EmulatedCluster was closed; create a new one")
            require_netem()
            self._env = absolute_program("env")
            self._started = True
            cleanup.register(self)
            try:
                self._build()
            except BaseException:
                self.close(raise_errors=False)
                raise
        log.info(
            "netem: started %d hosts in %s (%s; delay: %s)",
            self.n_hosts, self.tag, self.describe_schedule(), self.delay_backend or "none",
        )  # fmt: skip
        return self

    def _build(self) -> None:
        """Build the topology and the delay path; on any failure ``start`` tears down what exists."""
        net = self._net
        net.add_namespaces()
        self.delay_backend = choose_backend(net, self.phases, self._want_delay, self._backend_request)
        net.wire(bridged=self.delay_backend != "switch")
        first = self.phases[0] if self.phases else Phase(1.0)
        if self.delay_backend is not None:
            self._delay = DelayPath(net, self.delay_backend, first, self._switch_priority, self._tcp_buffer_max)
            self.delay_emulated = True
            self._host_delays = [(first.delay_s, first.jitter_s)] * self.n_hosts
            self.delay_s, self.jitter_s = first.delay_s, first.jitter_s
        if self.phases:
            net.shape(first.rate_bps, add=True)
            self.rate_bps = first.rate_bps

    # -- rate and delay ----------------------------------------------------------
    def set_rate(self, rate_bps: float, delay_s: float | None = None, jitter_s: float | None = None) -> None:
        """Change every link to ``rate_bps`` (both directions) with ``tc qdisc change``.

        ``delay_s``/``jitter_s``, when given, also set every host's one-way delay/jitter
        (see :meth:`set_delay`; None keeps the current value). A cluster without a delay
        path (see ``delay=``) only logs a warning for a non-zero delay, so schedules with
        delay still run there.
        """
        if rate_bps <= 0:
            raise ValueError(f"rate must be > 0, got {rate_bps!r}")
        with self._lock:
            self._require_open("set_rate")
            self._net.shape(rate_bps, add=self.rate_bps is None)  # built unshaped ("none"): add the tbfs now
            self.rate_bps = rate_bps
            if delay_s is None and jitter_s is None:
                return
            if self.delay_backend is None:
                self._maybe_warn_delay(delay_s or jitter_s)
                return
            self._apply_delay(
                None,
                self.delay_s if delay_s is None else delay_s,
                self.jitter_s if jitter_s is None else jitter_s,
            )

    def set_delay(self, delay_s: float, jitter_s: float = 0.0, host: int | None = None) -> None:
        """Set the one-way delay (and jitter) of what host ``host`` sends, or of every link.

        With jitter each packet's delay is uniform in ``delay_s +- jitter_s`` (clipped at 0)
        and packets may be reordered; without, they keep their order, also across a change.
        A change applies to packets sent after it, within milliseconds. RuntimeError if the
        cluster has no delay path (build it with ``delay=True`` or a schedule with a delay).
        """
        check_delay(delay_s, jitter_s)
        if host is not None:
            self._check_host(host)
        with self._lock:
            self._require_open("set_delay")
            if self.delay_backend is None:
                raise RuntimeError(
                    "this EmulatedCluster has no delay path; create it with delay=True "
                    "(or a schedule with a delay) to change delays while it runs"
                )
            self._apply_delay(host, delay_s, jitter_s)

    def _apply_delay(self, host: int | None, delay_s: float, jitter_s: float) -> None:
        assert self._delay is not None  # callers check delay_backend on an open cluster: the path is built
        self._delay.set_delay(host, delay_s, jitter_s)
        for i in range(self.n_hosts) if host is None else [host]:
            self._host_delays[i] = (delay_s, jitter_s)
        if host is None:
            self.delay_s, self.jitter_s = delay_s, jitter_s

    def host_delay(self, i: int) -> tuple[float, float]:
        """``(delay_s, jitter_s)`` currently applied to what host ``i`` sends."""
        self._check_host(i)
        return self._host_delays[i]

    @property
    def _switch(self) -> DelaySwitch | None:
        """The running delay switch (delay backend ``"switch"``), else None."""
        return self._delay.switch if self._delay is not None else None

    @property
    def switch_pid(self) -> int | None:
        """Pid of the delay switch process (``delay_backend == "switch"``), else None."""
        return self._switch.pid if self._switch is not None else None

    def switch_stats(self) -> dict[str, Any]:
        """Counters of the delay switch (frames, bytes, drops, timer lateness, per port)."""
        with self._lock:
            if self._switch is None or self._closed:
                raise RuntimeError("switch_stats needs an open cluster whose delay backend is the switch")
            return self._switch.stats()

    def _maybe_warn_delay(self, delay_s: float | None) -> None:
        if delay_s and not self.delay_emulated:
            cleanup.warn_once(
                "delay-not-emulated",
                "netem: delay requested but this cluster has no delay path (it was started with delay=False, "
                "or without delay in its schedule); latency is modelled, not emulated. Use "
                "EmulatedCluster(..., delay=True) to emulate it",
            )

    def _require_open(self, what: str) -> None:
        if not self._started or self._closed:
            raise RuntimeError(f"{what} needs a started, open EmulatedCluster")

    def start_schedule(self, on_change: Callable[[RateChange], None] | None = None,
                       paused: Callable[[], bool] | None = None) -> ScheduleRunner:
        """Start a :class:`ScheduleRunner` over this cluster's phases (standing still while ``paused()``); stopped on close."""
        runner = ScheduleRunner(self, self.phases, on_change=on_change, paused=paused)
        with self._lock:
            self._runners.append(runner)
        return runner.start()

    def describe_schedule(self) -> str:
        """Human-readable schedule, for logs."""
        return describe_phases(self.phases)

    def qdisc_show(self) -> str:
        """``tc qdisc show`` of every shaped device, one ``ns dev: ...`` block each."""
        return self._net.qdisc_show()

    # -- processes -----------------------------------------------------------
    def exec_prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command inside host ``i`` with gloo and NCCL bound to its interface.

        NCCL would otherwise bypass the emulated link between ranks on one machine: its
        peer-to-peer, shared-memory and InfiniBand transports ignore network namespaces.
        """
        self._check_host(i)
        ip = self._net.ip or tool_path("ip")
        env = self._env or absolute_program("env")
        ifname = self._net.host_if[i]
        return [ip, "netns", "exec", self._net.host_netns[i], env, f"GLOO_SOCKET_IFNAME={ifname}",
                f"NCCL_SOCKET_IFNAME={ifname}", *NCCL_SOCKETS_ONLY]  # fmt: skip

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Launch ``argv`` inside host ``i``; the process is terminated on close.

        ``env`` is *added* to the current environment (not a replacement), and
        ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` always name host ``i``'s interface.
        argv[0] is made absolute. Other keyword arguments go to ``subprocess.Popen``.
        """
        if not argv:
            raise ValueError("argv must not be empty")
        with self._lock:
            self._require_open("popen")
            cmd = [*self.exec_prefix(i), absolute_program(argv[0]), *argv[1:]]
            proc: subprocess.Popen[Any] = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, **kwargs)
            self._procs.append(proc)
            return proc

    # -- teardown --------------------------------------------------------------
    def close(self, raise_errors: bool = True) -> None:
        """Tear everything down (idempotent): runners, processes, the switch, veths, namespaces.

        Each step continues past failures so one stuck piece does not leave the rest
        behind; failures are logged and, if ``raise_errors``, raised together at the end.
        """
        errors: list[str] = []
        with cleanup.deferring_signals():
            # Stop runners before taking the lock: a runner blocked in set_rate
            # waits for that lock, and joining it while holding it would stall.
            for runner in list(self._runners):
                runner.stop(raise_error=False)
            with self._lock:
                if not self._closed:
                    self._closed = True
                    errors = self._teardown()
            cleanup.unregister(self)
        if errors:
            message = "netem cleanup incomplete (run cleanup_stale):\n" + "\n".join(errors)
            log.error(message)
            if raise_errors:
                raise RuntimeError(message)

    def _teardown(self) -> list[str]:
        errors: list[str] = []
        steps: list[tuple[str, Callable[[], None]]] = [("stopping processes", lambda: stop_processes(self._procs, 3.0))]
        if self._switch is not None:  # before the namespaces: a live process would keep its namespace alive
            steps.append(("stopping the delay switch", self._switch.stop))
        for what, step in steps:
            try:
                step()
            except Exception as exc:  # noqa: BLE001 - keep tearing down
                errors.append(f"{what}: {exc}")
        return errors + self._net.teardown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("started" if self._started else "new")
        return f"EmulatedCluster(n_hosts={self.n_hosts}, tag={self.tag!r}, {state}, {self.describe_schedule()})"
