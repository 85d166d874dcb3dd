"""Emulated hosts: one network namespace per rank, joined by a shaped bridge.

Topology (n hosts, everything inside namespaces this module creates)::

    ns <tag>-h0: lo, <p><pid>h0 10.99.0.1/24 --veth-- <p><pid>b0 \\
    ns <tag>-h1: lo, <p><pid>h1 10.99.0.2/24 --veth-- <p><pid>b1 -+- bridge <p><pid>br
    ...                                                            /  (ns <tag>-br, no address)

Each host's interface gets a ``tbf`` root qdisc (limits what the host sends)
and so does its bridge port (limits what the host receives), so a rank's
upload and download are both capped at the link rate, like a switch port.

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
import logging
import os
import re
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from types import FrameType
from typing import Any

from .commands import (
    NetemCommandError,
    netem_delay_args,
    require_netem,
    run_cmd,
    tbf_args,
    tool_path,
)
from .runner import RateChange, ScheduleRunner
from .schedule import Phase, parse_schedule

__all__ = ["EmulatedCluster", "cleanup_stale", "SUBNET", "MAX_HOSTS"]

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

    Raises:
        NetemUnavailable: on ``start()``/``__enter__`` without root or without
            ``ip``/``tc`` or working namespaces.
        ValueError: bad arguments, or names that would exceed 15 characters.
    """

    def __init__(self, n_hosts: int, schedule: str | Sequence[Phase] | None = "none", prefix: str = "fc") -> None:
        if not 1 <= n_hosts <= MAX_HOSTS:
            raise ValueError(f"n_hosts must be in 1..{MAX_HOSTS}, got {n_hosts}")
        if not _PREFIX_RE.match(prefix):
            raise ValueError(f"prefix must be 1-8 ASCII letters, got {prefix!r}")
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
        self.rate_bps: float | None = None
        self.delay_s = 0.0
        self.delay_emulated = False
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
        log.info("netem: started %d hosts in %s (%s)", self.n_hosts, self.tag, self.describe_schedule())
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
        br = self.bridge_netns
        self._ipn(br, "link", "add", self.bridge_if, "type", "bridge", "stp_state", "0", "forward_delay", "0")
        # No IPv6 link-local addresses: keeps the links silent (no RS/MLD chatter)
        # and leaves each host interface with exactly one address for gloo.
        self._ipn(br, "link", "set", self.bridge_if, "addrgenmode", "none")
        self._ipn(br, "link", "set", self.bridge_if, "up")
        for i in range(self.n_hosts):
            self._build_host(i)
        if self.phases:
            self._install_qdiscs(self.phases[0])

    def _build_host(self, i: int) -> None:
        """Veth pair created in the bridge ns with its peer placed straight into host i's ns."""
        br, ns, hif, port = self.bridge_netns, self._host_netns[i], self._host_if[i], self._port_if[i]
        self._ipn(br, "link", "add", port, "type", "veth", "peer", "name", hif, "netns", ns)
        self._ipn(br, "link", "set", port, "addrgenmode", "none")
        self._ipn(br, "link", "set", port, "master", self.bridge_if)
        self._ipn(br, "link", "set", port, "up")
        self._ipn(ns, "link", "set", hif, "addrgenmode", "none")
        self._ipn(ns, "addr", "add", f"{self.host_addr(i)}/24", "dev", hif)
        self._ipn(ns, "link", "set", hif, "up")

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

    def _install_qdiscs(self, phase: Phase) -> None:
        """Initial shaping: tbf on both ends of every veth, plus netem if delay is asked for."""
        wants_delay = any(p.delay_s > 0 for p in self.phases)
        if wants_delay and self._netem_supported():
            self.delay_emulated = True
        elif wants_delay:
            self._warn_no_netem()
        for i in range(self.n_hosts):
            ns, dev = self._host_netns[i], self._host_if[i]
            if self.delay_emulated:
                # Delay only on the host's egress: A->B then sees exactly one delay.
                self._tcn(ns, "qdisc", "add", "dev", dev, "root", "handle", _NETEM_HANDLE, *netem_delay_args(phase.delay_s))
                self._tcn(ns, "qdisc", "add", "dev", dev, "parent", _NETEM_CHILD_PARENT, "handle", _TBF_CHILD_HANDLE, *tbf_args(phase.rate_bps))
            else:
                self._tcn(ns, "qdisc", "add", "dev", dev, "root", *tbf_args(phase.rate_bps))
            self._tcn(self.bridge_netns, "qdisc", "add", "dev", self._port_if[i], "root", *tbf_args(phase.rate_bps))
        self.rate_bps = phase.rate_bps
        self.delay_s = phase.delay_s if self.delay_emulated else 0.0

    def set_rate(self, rate_bps: float, delay_s: float | None = None) -> None:
        """Change every link to ``rate_bps`` (both directions) with ``tc qdisc change``.

        ``delay_s`` updates the one-way delay when it is really emulated (netem
        present and the schedule asked for delay at start); otherwise it is
        only recorded in the warning log, because the qdisc tree cannot grow a
        netem stage that the kernel lacks.
        """
        if rate_bps <= 0:
            raise ValueError(f"rate must be > 0, got {rate_bps!r}")
        with self._lock:
            if not self._started or self._closed:
                raise RuntimeError("set_rate needs a started, open EmulatedCluster")
            if self.rate_bps is None:  # built unshaped ("none"): add the tbfs now
                self._install_qdiscs(Phase(rate_bps, None, 0.0))
                self._maybe_warn_delay(delay_s)
                return
            for i in range(self.n_hosts):
                self._change_host(i, rate_bps, delay_s)
                self._tcn(self.bridge_netns, "qdisc", "change", "dev", self._port_if[i], "root", *tbf_args(rate_bps))
            self.rate_bps = rate_bps
            if self.delay_emulated and delay_s is not None:
                self.delay_s = delay_s
            self._maybe_warn_delay(delay_s)

    def _change_host(self, i: int, rate_bps: float, delay_s: float | None) -> None:
        ns, dev = self._host_netns[i], self._host_if[i]
        if not self.delay_emulated:
            self._tcn(ns, "qdisc", "change", "dev", dev, "root", *tbf_args(rate_bps))
            return
        if delay_s is not None:
            self._tcn(ns, "qdisc", "change", "dev", dev, "root", "handle", _NETEM_HANDLE, *netem_delay_args(delay_s))
        self._tcn(ns, "qdisc", "change", "dev", dev, "parent", _NETEM_CHILD_PARENT, "handle", _TBF_CHILD_HANDLE, *tbf_args(rate_bps))

    @staticmethod
    def _warn_no_netem() -> None:
        _warn_once(
            "no-netem",
            "netem: the kernel has no 'netem' qdisc, so requested delays are not applied on the wire "
            "(latency is modelled, not emulated)",
        )

    def _maybe_warn_delay(self, delay_s: float | None) -> None:
        if delay_s and not self.delay_emulated:
            if _REG.netem_supported is False:
                self._warn_no_netem()
                return
            _warn_once(
                "delay-not-emulated",
                "netem: delay requested but not emulated on the wire (no netem qdisc, or the cluster was "
                "started without delay in its schedule); latency is modelled, not emulated",
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
        """argv prefix that runs a command inside host ``i`` with gloo bound to its interface."""
        self._check_host(i)
        ip = self._ip or tool_path("ip")
        env = self._env or _absolute_program("env")
        return [ip, "netns", "exec", self._host_netns[i], env, f"GLOO_SOCKET_IFNAME={self._host_if[i]}"]

    def popen(self, i: int, argv: Sequence[str], env: Mapping[str, str] | None = None, **kwargs: Any) -> subprocess.Popen[Any]:
        """Launch ``argv`` inside host ``i``; the process is terminated on close.

        ``env`` is *added* to the current environment (not a replacement), and
        ``GLOO_SOCKET_IFNAME`` always names host ``i``'s interface. argv[0] is
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

