"""Emulated hosts: one network namespace per rank, joined by a shaped bridge.

Topology (n hosts, everything inside namespaces this module creates)::

    ns <tag>-h0: lo, <p><pid>h0 10.99.0.1/24 --veth-- <p><pid>b0 \\
    ns <tag>-h1: lo, <p><pid>h1 10.99.0.2/24 --veth-- <p><pid>b1 -+- bridge <p><pid>br
    ...                                                            /  (ns <tag>-br, no address)

Each host's interface gets a ``tbf`` root qdisc (limits what the host sends)
and so does its bridge port (limits what the host receives), so a rank's
upload and download are both capped at the link rate, like a switch port.

Delay (one-way, per host link, changeable while a job runs, optional jitter)
is applied to what each host *sends*, so A -> B sees A's delay and a round
trip A -> B -> A sees A's plus B's. Two backends:

* ``netem`` where the kernel has it: a netem root qdisc on each host
  interface with the tbf as its child.
* otherwise a user-space switch (:mod:`flexcomm.netem.delay`) replaces the
  kernel bridge: a separate process in the bridge namespace reads every frame
  from the bridge-side veths with AF_PACKET sockets, holds it for the sending
  host's delay and writes it to the destination's port (whose tbf still
  shapes the download). Delay changes go to it over a pipe and apply to the
  next frame. It runs at SCHED_FIFO priority ``switch_priority`` so its
  timers fire on time on a busy machine; the MTU stays 1500 (GSO packets of
  up to 64 KiB pass through it whole), and the tbf burst is at least
  ``_SWITCH_MIN_BURST`` so tbf does not cut them up. The process is stopped
  with the cluster on every exit path, and exits by itself when its pipe
  closes (the cluster's process died).

A delay path is built when the schedule has a delay or jitter in any phase, or
when ``delay=True`` (e.g. to start at 0 ms and add delay later with
:meth:`EmulatedCluster.set_delay`). With a delay path, the hosts' TCP buffer
limits (``net.ipv4.tcp_rmem``/``tcp_wmem``, namespaced sysctls) are raised so
a window can cover bandwidth x round trip.

Nothing is done in the root namespace: veths are created inside the bridge
namespace with their peer placed directly into the host namespace, and the
10.99.0.0/24 addresses only ever exist inside these namespaces.

Cleanup is guaranteed on normal exit, on exceptions (context manager), on
SIGINT/SIGTERM (handlers clean up, then re-deliver the signal) and at
interpreter exit; :func:`cleanup_stale` removes what a SIGKILLed run left.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import re
import shutil
import signal
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

from .commands import (
    NetemCommandError,
    NetemUnavailable,
    netem_delay_args,
    require_netem,
    run_cmd,
    tbf_args,
    tool_path,
)
from .runner import RateChange, ScheduleRunner
from .schedule import Phase, parse_schedule

__all__ = ["EmulatedCluster", "cleanup_stale", "SUBNET", "MAX_HOSTS", "DELAY_BACKENDS"]

log = logging.getLogger("flexcomm.netem")

#: The only addresses this module assigns, and only inside its own namespaces.
SUBNET = "10.99.0.0/24"
MAX_HOSTS = 254
_IFNAME_MAX = 15  # IFNAMSIZ - 1
_PREFIX_RE = re.compile(r"^[A-Za-z]{1,8}$")
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# netem handles used when a delay tree is built (netem root, tbf child).
_NETEM_HANDLE = "1:"
_NETEM_CHILD_PARENT = "1:1"
_TBF_CHILD_HANDLE = "10:"
#: Values of EmulatedCluster(delay_backend=...).
DELAY_BACKENDS = ("auto", "netem", "switch")
#: Smallest tbf burst with the delay switch: a whole 64 KiB GSO packet (plus the
#: per-segment headers tbf counts) must fit, or tbf cuts it into ~45 MTU-sized
#: frames that the switch then has to forward one by one (measured at 100 Mbit/s:
#: ~20k frames/s and ~35% of a core instead of ~200 frames/s and ~3%).
_SWITCH_MIN_BURST = 80_000
#: Seconds to wait for the delay switch to start / to answer a command.
_SWITCH_START_TIMEOUT = 30.0
_SWITCH_REPLY_TIMEOUT = 10.0


# --------------------------------------------------------------------------
# Process-wide registry of live clusters, signal handlers and warnings.
# --------------------------------------------------------------------------
class _Registry:
    """Live clusters plus the signal handlers that clean them up.

    Kept in one object so the signal handler, atexit hook and ``close`` agree
    on state; ``in_cleanup``/``pending`` defer a signal that arrives while a
    cleanup is already running, so the cleanup is never cut in half.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.live: dict[int, EmulatedCluster] = {}
        self.prev_handlers: dict[int, Any] = {}
        self.handlers_installed = False
        self.in_cleanup = 0
        self.pending: int | None = None
        self.atexit_registered = False
        self.seq = itertools.count()
        self.netem_supported: bool | None = None
        self.warned: set[str] = set()


_REG = _Registry()


def _warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key not in _REG.warned:
        _REG.warned.add(key)
        log.warning(message)


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install_handlers() -> None:
    """Install SIGINT/SIGTERM cleanup handlers (main thread only; Python's rule)."""
    if _REG.handlers_installed:
        return
    if not _is_main_thread():
        _warn_once("thread", "netem: cluster started off the main thread; no SIGINT/SIGTERM cleanup handlers")
        return
    _REG.prev_handlers.clear()
    for sig in _HANDLED_SIGNALS:
        prev = signal.getsignal(sig)
        if prev == signal.SIG_IGN:
            continue  # the process chose to ignore it (e.g. nohup, background job): respect that
        _REG.prev_handlers[sig] = prev
        signal.signal(sig, _on_signal)
    _REG.handlers_installed = True


def _restore_handlers() -> None:
    """Put back the handlers we replaced, unless someone replaced ours since.

    ``prev_handlers`` is kept so a deferred signal can still be re-delivered
    to the handler that was in place before us.
    """
    if not _REG.handlers_installed or not _is_main_thread():
        return
    for sig, prev in _REG.prev_handlers.items():
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
    _REG.handlers_installed = False


def _redeliver(signum: int, frame: FrameType | None) -> None:
    """After cleanup, let the signal have the effect it would have had without us."""
    if not _is_main_thread():
        os.kill(os.getpid(), signum)  # our handler (still installed) runs in the main thread
        return
    prev = _REG.prev_handlers.get(signum, signal.SIG_DFL)
    _restore_handlers()
    if callable(prev):
        prev(signum, frame)  # e.g. default_int_handler raises KeyboardInterrupt
    elif prev != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """SIGINT/SIGTERM: remove every live cluster, then re-deliver the signal."""
    if _REG.in_cleanup:
        _REG.pending = signum
        return
    _cleanup_all()
    _redeliver(signum, frame)


def _cleanup_all() -> None:
    """Close every live cluster of this process without raising (signals, atexit)."""
    for cluster in list(_REG.live.values()):
        cluster.close(raise_errors=False)


def _register(cluster: EmulatedCluster) -> None:
    with _REG.lock:
        _REG.live[id(cluster)] = cluster
        _install_handlers()
        if not _REG.atexit_registered:
            atexit.register(_cleanup_all)
            _REG.atexit_registered = True


def _unregister(cluster: EmulatedCluster) -> None:
    with _REG.lock:
        _REG.live.pop(id(cluster), None)
        if not _REG.live:
            _restore_handlers()


# --------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------
def _absolute_program(program: str) -> str:
    """Make argv[0] absolute: ``ip netns exec`` failed with a relative interpreter path.

    ``os.path.abspath`` (not ``realpath``) keeps a venv's ``bin/python``
    symlink intact, which is how Python finds the venv.
    """
    if os.path.isabs(program):
        return program
    if os.sep in program:
        return os.path.abspath(program)
    found = shutil.which(program)
    if found is None:
        raise FileNotFoundError(f"program {program!r} not found on PATH")
    return os.path.abspath(found)


def _netem_args(delay_s: float, jitter_s: float = 0.0) -> list[str]:
    """``netem delay D [J]`` (microseconds); netem's jitter is uniform in D +- J by default."""
    args = netem_delay_args(delay_s)
    if jitter_s > 0:
        args.append(f"{max(1, int(round(jitter_s * 1e6)))}us")
    return args


def _check_delay(delay_s: float, jitter_s: float) -> None:
    for name, value in (("delay_s", delay_s), ("jitter_s", jitter_s)):
        if not (isinstance(value, (int, float)) and 0 <= value <= 3600):
            raise ValueError(f"{name} must be a number of seconds in [0, 3600], got {value!r}")


def _list_netns(ip: str) -> list[str]:
    """Names from ``ip netns list`` (lines look like ``name (id: 3)``)."""
    return [line.split()[0] for line in run_cmd([ip, "netns", "list"]).splitlines() if line.strip()]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _stale_name_re(prefix: str) -> re.Pattern[str]:
    """Namespace names made by EmulatedCluster: ``<prefix><pid>-<seq>-(h<i>|br)``."""
    return re.compile(rf"^{re.escape(prefix)}(\d+)-(\d+)-(h\d+|br)$")


def cleanup_stale(prefix: str = "fc", force: bool = False) -> list[str]:
    """Delete namespaces left by crashed (e.g. SIGKILLed) clusters; return their names.

    Only names of the exact form this module creates are considered, and by
    default only those whose creating pid no longer exists, so concurrent runs
    (other processes, other users of the machine) are left alone. ``force``
    also removes namespaces of live pids - use only when nothing else runs.
    Bridge namespaces go first: destroying them deletes every veth pair.
    Processes still inside a stale namespace are reported, not killed.
    """
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix must be 1-8 ASCII letters, got {prefix!r}")
    require_netem()
    ip = tool_path("ip")
    pattern = _stale_name_re(prefix)
    own = {name for c in list(_REG.live.values()) for name in c.namespaces}
    candidates = []
    for name in _list_netns(ip):
        match = pattern.match(name)
        if match is None or name in own:
            continue
        pid = int(match.group(1))
        if force or pid == os.getpid() or not _pid_alive(pid):
            candidates.append(name)
    candidates.sort(key=lambda n: (not n.endswith("-br"), n))
    removed = []
    for name in candidates:
        pids = run_cmd([ip, "netns", "pids", name]).split()
        if pids:
            log.warning("netem: stale namespace %s still has processes %s; it lingers until they exit", name, pids)
        try:
            run_cmd([ip, "netns", "delete", name])
            removed.append(name)
        except NetemCommandError as exc:
            log.warning("netem: could not delete stale namespace %s: %s", name, exc)
    return removed


# --------------------------------------------------------------------------
# The cluster
# --------------------------------------------------------------------------
class EmulatedCluster:
    """``n_hosts`` emulated machines with shaped links, as a context manager.

    Example::

        with EmulatedCluster(2, "1gbit:30s,100mbit") as cluster:
            procs = [cluster.popen(i, [sys.executable, "train.py", str(i)]) for i in range(2)]
            with cluster.start_schedule():
                for p in procs:
                    p.wait()

    Args:
        n_hosts: number of hosts (1..254); host i is ``10.99.0.(i+1)``.
        schedule: a schedule string (see :mod:`flexcomm.netem.schedule`) or
            parsed phases. The first phase's rate is applied when the cluster
            starts; ``"none"`` leaves links unshaped (``set_rate`` still works).
        prefix: 1-8 letters starting every namespace and interface name; names
            also carry the pid (and a per-process counter for namespaces) so
            concurrent clusters never clash and :func:`cleanup_stale` can tell
            live runs from dead ones.
        delay: build a delay path? ``None`` (default): only if some phase of
            the schedule has a delay or jitter; ``True``: always, so
            :meth:`set_delay` works on a schedule without delay (and a 0 ms
            baseline goes through the same path); ``False``: never (requested
            delays are then only logged).
        delay_backend: ``"auto"`` (netem if the kernel has it, else the
            user-space switch), ``"netem"`` (fail without it) or ``"switch"``.
        switch_priority: SCHED_FIFO priority of the switch process (1-99), so
            its timers fire on time on a busy machine; 0 = normal scheduling.
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
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix must be 1-8 ASCII letters, got {prefix!r}")
        if delay_backend not in DELAY_BACKENDS:
            raise ValueError(f"delay_backend must be one of {DELAY_BACKENDS}, got {delay_backend!r}")
        if not 0 <= switch_priority <= 99:
            raise ValueError(f"switch_priority must be in 0..99, got {switch_priority!r}")
        self.n_hosts = n_hosts
        self.prefix = prefix
        self.phases: list[Phase] = parse_schedule(schedule) if isinstance(schedule, str) or schedule is None else list(schedule)
        pid = os.getpid()
        self.tag = f"{prefix}{pid}-{next(_REG.seq)}"
        self.bridge_netns = f"{self.tag}-br"
        self._host_netns = [f"{self.tag}-h{i}" for i in range(n_hosts)]
        self._host_if = [f"{prefix}{pid}h{i}" for i in range(n_hosts)]
        self._port_if = [f"{prefix}{pid}b{i}" for i in range(n_hosts)]
        self.bridge_if = f"{prefix}{pid}br"
        for name in (*self._host_if, *self._port_if, self.bridge_if):
            if len(name) > _IFNAME_MAX:
                raise ValueError(
                    f"interface name {name!r} exceeds Linux's {_IFNAME_MAX}-character limit; use a shorter prefix"
                )
        for p in self.phases:
            _check_delay(p.delay_s, p.jitter_s)
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
        self._switch: subprocess.Popen[bytes] | None = None
        self._switch_stderr: Any = None
        self._switch_buf = b""
        self._switch_lock = threading.Lock()
        self._created_ns: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._runners: list[ScheduleRunner] = []
        self._lock = threading.RLock()
        self._started = False
        self._closed = False
        self._ip = ""
        self._tc = ""
        self._env = ""

    # -- naming / addressing -------------------------------------------------
    @property
    def namespaces(self) -> list[str]:
        """Every namespace name of this cluster (bridge first)."""
        return [self.bridge_netns, *self._host_netns]

    def _check_host(self, i: int) -> None:
        if not 0 <= i < self.n_hosts:
            raise IndexError(f"host index {i} out of range 0..{self.n_hosts - 1}")

    def host_addr(self, i: int) -> str:
        """IPv4 address of host ``i`` (``10.99.0.(i+1)``), valid inside the cluster only."""
        self._check_host(i)
        return f"10.99.0.{i + 1}"

    def host_netns(self, i: int) -> str:
        """Network namespace name of host ``i``."""
        self._check_host(i)
        return self._host_netns[i]

    def host_ifname(self, i: int) -> str:
        """Interface of host ``i`` (what ``GLOO_SOCKET_IFNAME`` is set to)."""
        self._check_host(i)
        return self._host_if[i]

    def bridge_port(self, i: int) -> str:
        """Bridge-side veth of host ``i``; its qdisc limits traffic *to* host ``i``."""
        self._check_host(i)
        return self._port_if[i]

    def links(self) -> list[tuple[str, str]]:
        """``(namespace, device)`` of every shaped interface: host sides, then bridge ports."""
        return list(zip(self._host_netns, self._host_if)) + [(self.bridge_netns, p) for p in self._port_if]

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
            self._ip, self._tc = tool_path("ip"), tool_path("tc")
            self._env = _absolute_program("env")
            self._started = True
            _register(self)
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

    def _ipn(self, ns: str, *args: str) -> str:
        return run_cmd([self._ip, "-n", ns, *args])

    def _tcn(self, ns: str, *args: str) -> str:
        return run_cmd([self._tc, "-n", ns, *args])

    def _add_netns(self, name: str) -> None:
        run_cmd([self._ip, "netns", "add", name])
        self._created_ns.append(name)
        self._ipn(name, "link", "set", "lo", "up")

    def _build(self) -> None:
        """Build the topology; on any failure ``start`` tears down what exists."""
        for ns in self.namespaces:
            self._add_netns(ns)
        self.delay_backend = self._choose_delay_backend()
        first = self.phases[0] if self.phases else Phase(1.0)
        br = self.bridge_netns
        if self.delay_backend != "switch":
            self._ipn(br, "link", "add", self.bridge_if, "type", "bridge", "stp_state", "0", "forward_delay", "0")
            # No IPv6 link-local addresses: keeps the links silent (no RS/MLD chatter)
            # and leaves each host interface with exactly one address for gloo.
            self._ipn(br, "link", "set", self.bridge_if, "addrgenmode", "none")
            self._ipn(br, "link", "set", self.bridge_if, "up")
        for i in range(self.n_hosts):
            self._build_host(i)
        if self.delay_backend is not None:
            self._raise_tcp_buffers()
            if self.delay_backend == "netem":
                for i in range(self.n_hosts):
                    self._tcn(
                        self._host_netns[i], "qdisc", "add", "dev", self._host_if[i], "root",
                        "handle", _NETEM_HANDLE, *_netem_args(first.delay_s, first.jitter_s),
                    )  # fmt: skip
            else:
                self._start_switch(first.delay_s, first.jitter_s)
            self.delay_emulated = True
            self._host_delays = [(first.delay_s, first.jitter_s)] * self.n_hosts
            self.delay_s, self.jitter_s = first.delay_s, first.jitter_s
        if self.phases:
            self._install_qdiscs(first)

    def _build_host(self, i: int) -> None:
        """Veth pair created in the bridge ns with its peer placed straight into host i's ns."""
        br, ns, hif, port = self.bridge_netns, self._host_netns[i], self._host_if[i], self._port_if[i]
        self._ipn(br, "link", "add", port, "type", "veth", "peer", "name", hif, "netns", ns)
        self._ipn(br, "link", "set", port, "addrgenmode", "none")
        if self.delay_backend != "switch":  # with the switch, the ports stay unbridged: it forwards
            self._ipn(br, "link", "set", port, "master", self.bridge_if)
        self._ipn(br, "link", "set", port, "up")
        self._ipn(ns, "link", "set", hif, "addrgenmode", "none")
        self._ipn(ns, "addr", "add", f"{self.host_addr(i)}/24", "dev", hif)
        self._ipn(ns, "link", "set", hif, "up")

    def _choose_delay_backend(self) -> str | None:
        """Which delay path to build, if any (namespaces must exist: netem is probed in one)."""
        wants = self._want_delay
        if wants is None:
            wants = any(p.delay_s > 0 or p.jitter_s > 0 for p in self.phases)
        if not wants:
            return None
        if self._backend_request == "switch":
            return "switch"
        if self._netem_supported():
            return "netem"
        if self._backend_request == "netem":
            raise NetemUnavailable("delay_backend='netem' but this kernel has no netem qdisc; use 'auto' or 'switch'")
        return "switch"

    def _raise_tcp_buffers(self) -> None:
        """Let TCP windows cover bandwidth x RTT: raise tcp_rmem/tcp_wmem maxima in the host namespaces.

        These sysctls are per network namespace, so nothing outside the
        cluster changes; the minimum and default stay as the kernel set them.
        """
        if self._tcp_buffer_max <= 0:
            return
        try:
            sysctl = tool_path("sysctl")
        except NetemUnavailable:
            _warn_once("no-sysctl", "netem: no 'sysctl' binary; TCP buffer limits in the hosts left as they are")
            return
        for ns in self._host_netns:
            settings = []
            for key in ("net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"):
                values = run_cmd([self._ip, "netns", "exec", ns, sysctl, "-n", key]).split()
                if len(values) == 3 and int(values[2]) < self._tcp_buffer_max:
                    settings.append(f"{key}={values[0]} {values[1]} {self._tcp_buffer_max}")
            if settings:
                run_cmd([self._ip, "netns", "exec", ns, sysctl, "-q", "-w", *settings])

    def _netem_supported(self) -> bool:
        """Probe once per process whether the kernel has the netem qdisc."""
        if _REG.netem_supported is None:
            ns = self._host_netns[0]
            try:
                self._tcn(ns, "qdisc", "add", "dev", "lo", "root", *netem_delay_args(0.001))
                self._tcn(ns, "qdisc", "del", "dev", "lo", "root")
                _REG.netem_supported = True
            except NetemCommandError as exc:
                if "unknown" not in exc.stderr.lower():
                    # Some other failure: do not conclude (and cache) "no netem".
                    log.warning("netem: could not probe for the netem qdisc: %s", exc)
                    return False
                _REG.netem_supported = False
        return _REG.netem_supported

    def _tbf(self, rate_bps: float) -> list[str]:
        """tbf arguments for this cluster: :func:`tbf_args`, with a burst >= one GSO packet behind the switch."""
        args = tbf_args(rate_bps)
        if self.delay_backend == "switch":
            i = args.index("burst") + 1
            args[i] = str(max(int(args[i]), _SWITCH_MIN_BURST))
        return args

    def _install_qdiscs(self, phase: Phase) -> None:
        """First shaping: tbf on both ends of every veth (under netem's root if that backend is used)."""
        for i in range(self.n_hosts):
            ns, dev = self._host_netns[i], self._host_if[i]
            if self.delay_backend == "netem":
                # Delay only on the host's egress: A->B then sees exactly one delay.
                self._tcn(ns, "qdisc", "add", "dev", dev, "parent", _NETEM_CHILD_PARENT, "handle", _TBF_CHILD_HANDLE, *self._tbf(phase.rate_bps))
            else:
                self._tcn(ns, "qdisc", "add", "dev", dev, "root", *self._tbf(phase.rate_bps))
            self._tcn(self.bridge_netns, "qdisc", "add", "dev", self._port_if[i], "root", *self._tbf(phase.rate_bps))
        self.rate_bps = phase.rate_bps

    def set_rate(self, rate_bps: float, delay_s: float | None = None, jitter_s: float | None = None) -> None:
        """Change every link to ``rate_bps`` (both directions) with ``tc qdisc change``.

        ``delay_s``/``jitter_s``, when given, also set every host's one-way
        delay/jitter (see :meth:`set_delay`; None keeps the current value). A
        cluster without a delay path (see ``delay=``) only logs a warning for a
        non-zero delay, so schedules with delay still run there.
        """
        if rate_bps <= 0:
            raise ValueError(f"rate must be > 0, got {rate_bps!r}")
        with self._lock:
            if not self._started or self._closed:
                raise RuntimeError("set_rate needs a started, open EmulatedCluster")
            if self.rate_bps is None:  # built unshaped ("none"): add the tbfs now
                self._install_qdiscs(Phase(rate_bps))
            else:
                for i in range(self.n_hosts):
                    ns, dev = self._host_netns[i], self._host_if[i]
                    if self.delay_backend == "netem":
                        self._tcn(ns, "qdisc", "change", "dev", dev, "parent", _NETEM_CHILD_PARENT, "handle", _TBF_CHILD_HANDLE, *self._tbf(rate_bps))
                    else:
                        self._tcn(ns, "qdisc", "change", "dev", dev, "root", *self._tbf(rate_bps))
                    self._tcn(self.bridge_netns, "qdisc", "change", "dev", self._port_if[i], "root", *self._tbf(rate_bps))
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
        """Set the one-way delay (and jitter) of host ``host``'s link, or of every link.

        The delay applies to what the host sends: A -> B takes A's delay, a
        round trip A -> B -> A takes A's plus B's. With jitter each packet's
        delay is uniform in ``delay_s +- jitter_s`` (clipped at 0) and packets
        may be reordered; without jitter they keep their order, also across a
        change. A change applies to packets sent after it (packets already in
        flight keep their delay), within milliseconds.

        Raises:
            RuntimeError: the cluster has no delay path (build it with
                ``delay=True`` or a schedule that has a delay).
        """
        _check_delay(delay_s, jitter_s)
        if host is not None:
            self._check_host(host)
        with self._lock:
            if not self._started or self._closed:
                raise RuntimeError("set_delay needs a started, open EmulatedCluster")
            if self.delay_backend is None:
                raise RuntimeError(
                    "this EmulatedCluster has no delay path; create it with delay=True "
                    "(or a schedule with a delay) to change delays while it runs"
                )
            self._apply_delay(host, delay_s, jitter_s)

    def _apply_delay(self, host: int | None, delay_s: float, jitter_s: float) -> None:
        _check_delay(delay_s, jitter_s)
        hosts = range(self.n_hosts) if host is None else [host]
        if self.delay_backend == "switch":
            self._switch_command(f"delay {'*' if host is None else host} {delay_s!r} {jitter_s!r}")
        else:
            for i in hosts:
                self._tcn(
                    self._host_netns[i], "qdisc", "change", "dev", self._host_if[i], "root",
                    "handle", _NETEM_HANDLE, *_netem_args(delay_s, jitter_s),
                )  # fmt: skip
        for i in hosts:
            self._host_delays[i] = (delay_s, jitter_s)
        if host is None:
            self.delay_s, self.jitter_s = delay_s, jitter_s

    def host_delay(self, i: int) -> tuple[float, float]:
        """``(delay_s, jitter_s)`` currently applied to what host ``i`` sends."""
        self._check_host(i)
        return self._host_delays[i]

    # -- the user-space delay switch --------------------------------------------
    @property
    def switch_pid(self) -> int | None:
        """Pid of the delay switch process (``delay_backend == "switch"``), else None."""
        return self._switch.pid if self._switch is not None and self._switch.poll() is None else None

    def _start_switch(self, delay_s: float, jitter_s: float) -> None:
        """Start :mod:`flexcomm.netem.delay` in the bridge namespace and wait for ``ready``.

        It runs as ``python -I delay.py``: isolated mode keeps the package
        directory off sys.path, and the script needs only the standard library
        (importing the flexcomm package would import torch).
        """
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay.py")
        argv = [
            self._ip, "netns", "exec", self.bridge_netns, _absolute_program(sys.executable or "python3"), "-I", script,
            *(arg for port in self._port_if for arg in ("--port", port)),
            "--delay", repr(delay_s), "--jitter", repr(jitter_s), "--realtime", str(self._switch_priority),
        ]  # fmt: skip
        self._switch_stderr = tempfile.TemporaryFile()
        # Own session: a Ctrl-C meant for the job must not take the network down under it.
        self._switch = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._switch_stderr, start_new_session=True
        )
        try:
            line = self._switch_readline(_SWITCH_START_TIMEOUT)
        except RuntimeError as exc:
            raise NetemCommandError(argv, self._switch.poll() or -1, str(exc)) from None
        if not line.startswith("ready"):
            raise NetemCommandError(argv, -1, f"unexpected first line {line!r}")
        log.info("netem: delay switch pid %d in %s", self._switch.pid, self.bridge_netns)

    def _switch_error_text(self) -> str:
        if self._switch_stderr is None:
            return ""
        try:
            self._switch_stderr.seek(0)
            return self._switch_stderr.read().decode(errors="replace")[-2000:]
        except (OSError, ValueError):
            return ""

    def _switch_readline(self, timeout: float) -> str:
        """One reply line from the switch (raw fd + select: never blocks past ``timeout``)."""
        assert self._switch is not None and self._switch.stdout is not None
        fd = self._switch.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._switch_buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"delay switch did not answer within {timeout:g}s")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    rc = self._switch.poll()
                    raise RuntimeError(f"delay switch exited (rc={rc}): {self._switch_error_text().strip()}")
                self._switch_buf += chunk
        line, self._switch_buf = self._switch_buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def _switch_command(self, line: str) -> str:
        """Send one control line to the switch; return its ``ok ...`` reply (raise on ``error``)."""
        with self._switch_lock:
            if self._switch is None or self._switch.stdin is None:
                raise RuntimeError("no delay switch running")
            try:
                self._switch.stdin.write(line.encode() + b"\n")
                self._switch.stdin.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                raise RuntimeError(f"delay switch is gone ({exc}): {self._switch_error_text().strip()}") from None
            reply = self._switch_readline(_SWITCH_REPLY_TIMEOUT)
        if not reply.startswith("ok"):
            raise RuntimeError(f"delay switch refused {line!r}: {reply}")
        return reply[2:].strip()

    def switch_stats(self) -> dict[str, Any]:
        """Counters of the delay switch (frames, bytes, drops, timer lateness, per port)."""
        with self._lock:
            if self.delay_backend != "switch" or self._closed:
                raise RuntimeError("switch_stats needs an open cluster whose delay backend is the switch")
            return dict(json.loads(self._switch_command("stats")))

    def _stop_switch(self, grace_s: float = 2.0) -> None:
        """Stop the switch (SIGTERM, then SIGKILL); safe from a signal handler."""
        proc, self._switch = self._switch, None
        if proc is not None:
            try:
                rc = proc.poll()
                if rc is not None:  # it died while the cluster was up: say so (its traffic stopped then)
                    log.error("netem: the delay switch had exited (rc=%s): %s", rc, self._switch_error_text().strip())
                else:
                    proc.terminate()
                    try:
                        proc.wait(grace_s)
                    except subprocess.TimeoutExpired:
                        proc.kill()
                        proc.wait(grace_s)
            finally:
                for stream in (proc.stdin, proc.stdout):
                    try:
                        if stream is not None:
                            stream.close()
                    except OSError:
                        pass
        if self._switch_stderr is not None:
            try:
                self._switch_stderr.close()
            except OSError:
                pass
            self._switch_stderr = None

    def _maybe_warn_delay(self, delay_s: float | None) -> None:
        if delay_s and not self.delay_emulated:
            _warn_once(
                "delay-not-emulated",
                "netem: delay requested but this cluster has no delay path (it was started with delay=False, "
                "or without delay in its schedule); latency is modelled, not emulated. Use "
                "EmulatedCluster(..., delay=True) to emulate it",
            )

    def start_schedule(self, on_change: Callable[[RateChange], None] | None = None) -> ScheduleRunner:
        """Start a :class:`ScheduleRunner` over this cluster's phases; stopped on close."""
        runner = ScheduleRunner(self, self.phases, on_change=on_change)
        with self._lock:
            self._runners.append(runner)
        return runner.start()

    def describe_schedule(self) -> str:
        """Human-readable schedule, for logs."""
        if not self.phases:
            return "no shaping"
        parts = []
        for p in self.phases:
            dur = "until the end" if p.duration_s is None else f"for {p.duration_s:g}s"
            delay = f", delay {p.delay_s * 1e3:g}ms" if p.delay_s else ""
            if p.jitter_s:
                delay += f" ~{p.jitter_s * 1e3:g}ms jitter"
            parts.append(f"{p.rate_bps / 1e6:g} Mbit/s{delay} {dur}")
        return "; ".join(parts)

    def qdisc_show(self) -> str:
        """``tc qdisc show`` of every shaped device, one ``ns dev: ...`` block each."""
        out = []
        for ns, dev in self.links():
            out.append(f"{ns} {dev}: {self._tcn(ns, 'qdisc', 'show', 'dev', dev).strip()}")
        return "\n".join(out)

    # -- processes -----------------------------------------------------------
    def exec_prefix(self, i: int) -> list[str]:
        """argv prefix that runs a command inside host ``i`` with gloo and NCCL bound to its interface."""
        self._check_host(i)
        ip = self._ip or tool_path("ip")
        env = self._env or _absolute_program("env")
        ifname = self._host_if[i]
        return [ip, "netns", "exec", self._host_netns[i], env, f"GLOO_SOCKET_IFNAME={ifname}", f"NCCL_SOCKET_IFNAME={ifname}"]

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Launch ``argv`` inside host ``i``; the process is terminated on close.

        ``env`` is *added* to the current environment (not a replacement), and
        ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` always name host ``i``'s interface. argv[0] is
        made absolute. Other keyword arguments go to ``subprocess.Popen``.
        """
        if not argv:
            raise ValueError("argv must not be empty")
        with self._lock:
            if not self._started or self._closed:
                raise RuntimeError("popen needs a started, open EmulatedCluster")
            full_env = dict(os.environ)
            full_env.update(env or {})
            cmd = [*self.exec_prefix(i), _absolute_program(argv[0]), *argv[1:]]
            proc: subprocess.Popen[Any] = subprocess.Popen(cmd, env=full_env, **kwargs)
            self._procs.append(proc)
            return proc

    def _stop_processes(self, grace_s: float = 3.0) -> None:
        """Terminate (then kill) processes we launched that are still running."""
        alive = [p for p in self._procs if p.poll() is None]
        for p in alive:
            p.terminate()
        for p in alive:
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(grace_s)

    # -- teardown --------------------------------------------------------------
    def close(self, raise_errors: bool = True) -> None:
        """Tear everything down (idempotent): runners, processes, veths, namespaces.

        Each step continues past failures so one stuck piece does not leave the
        rest behind; failures are logged and, if ``raise_errors``, raised
        together at the end.
        """
        errors: list[str] = []
        _REG.in_cleanup += 1
        try:
            # Stop runners before taking the lock: a runner blocked in set_rate
            # waits for that lock, and joining it while holding it would stall.
            for runner in list(self._runners):
                runner.stop(raise_error=False)
            with self._lock:
                if not self._closed:
                    self._closed = True
                    errors = self._teardown()
            _unregister(self)
        finally:
            _REG.in_cleanup -= 1
        if _REG.in_cleanup == 0 and _REG.pending is not None:
            sig, _REG.pending = _REG.pending, None
            _redeliver(sig, None)
        if errors:
            message = "netem cleanup incomplete (run cleanup_stale):\n" + "\n".join(errors)
            log.error(message)
            if raise_errors:
                raise RuntimeError(message)

    def _teardown(self) -> list[str]:
        errors: list[str] = []
        try:
            self._stop_processes()
        except Exception as exc:  # noqa: BLE001 - keep tearing down
            errors.append(f"stopping processes: {exc}")
        try:
            self._stop_switch()  # before the namespaces: a live process would keep its namespace alive
        except Exception as exc:  # noqa: BLE001 - keep tearing down
            errors.append(f"stopping the delay switch: {exc}")
        if not self._created_ns:
            return errors
        ip = self._ip or tool_path("ip")
        if self.bridge_netns in self._created_ns:
            # Deleting one end deletes the pair now; namespace teardown is asynchronous.
            for port in self._port_if:
                try:
                    run_cmd([ip, "-n", self.bridge_netns, "link", "del", port])
                except NetemCommandError:
                    pass  # not created yet, or already gone with its peer
        for ns in self._created_ns:
            try:
                run_cmd([ip, "netns", "delete", ns])
            except NetemCommandError as exc:
                errors.append(str(exc))
        self._created_ns.clear()
        return errors

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("started" if self._started else "new")
        return f"EmulatedCluster(n_hosts={self.n_hosts}, tag={self.tag!r}, {state}, {self.describe_schedule()})"

