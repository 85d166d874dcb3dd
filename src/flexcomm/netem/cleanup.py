"""Clean-up of emulated clusters: the live registry, signal and atexit handlers, stale namespaces.

Every started cluster registers here; on SIGINT/SIGTERM the handlers close every live
cluster of this process, then re-deliver the signal so it has the effect it would have had
without us (``KeyboardInterrupt``, or the default action); at interpreter exit the atexit
hook closes what is left. A signal that arrives while a clean-up runs is deferred until
it ends (:func:`deferring_signals`), so a clean-up is never cut in half.
:func:`cleanup_stale` removes what a SIGKILLed run left behind.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import logging
import os
import re
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, Protocol

from .commands import NetemCommandError, require_netem, run_cmd, tool_path

__all__ = ["cleanup_stale", "check_prefix", "deferring_signals", "next_cluster_seq", "register", "unregister",
           "warn_once"]  # fmt: skip

log = logging.getLogger("flexcomm.netem")

_PREFIX_RE = re.compile(r"^[A-Za-z]{1,8}$")
_HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Closable(Protocol):
    """What the registry needs of a cluster."""

    @property
    def namespaces(self) -> list[str]: ...

    def close(self, raise_errors: bool = True) -> None: ...


class _Registry:
    """Live clusters plus the signal handlers that clean them up.

    Kept in one object so the signal handler, atexit hook and ``close`` agree on state;
    ``in_cleanup``/``pending`` defer a signal that arrives while a clean-up is running.
    """

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.live: dict[int, Closable] = {}
        self.prev_handlers: dict[int, Any] = {}
        self.handlers_installed = False
        self.in_cleanup = 0
        self.pending: int | None = None
        self.atexit_registered = False
        self.seq = itertools.count()
        self.warned: set[str] = set()


_REG = _Registry()


def check_prefix(prefix: str) -> None:
    """Names start with 1-8 letters, so :func:`cleanup_stale` can parse them back."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"prefix must be 1-8 ASCII letters, got {prefix!r}")


def next_cluster_seq() -> int:
    """A per-process counter, so two clusters of one process never share a name."""
    return next(_REG.seq)


def warn_once(key: str, message: str) -> None:
    """Log ``message`` as a warning the first time ``key`` is seen in this process."""
    if key not in _REG.warned:
        _REG.warned.add(key)
        log.warning(message)


def _is_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


def _install_handlers() -> None:
    """Install SIGINT/SIGTERM clean-up handlers (main thread only; Python's rule)."""
    if _REG.handlers_installed:
        return
    if not _is_main_thread():
        warn_once("thread", "netem: cluster started off the main thread; no SIGINT/SIGTERM cleanup handlers")
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

    ``prev_handlers`` is kept so a deferred signal can still be re-delivered to the
    handler that was in place before us.
    """
    if not _REG.handlers_installed or not _is_main_thread():
        return
    for sig, prev in _REG.prev_handlers.items():
        if signal.getsignal(sig) is _on_signal:
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
    _REG.handlers_installed = False


def _redeliver(signum: int, frame: FrameType | None) -> None:
    """After clean-up, let the signal have the effect it would have had without us."""
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


def register(cluster: Closable) -> None:
    """A cluster is being built: from now on signals and interpreter exit clean it up."""
    with _REG.lock:
        _REG.live[id(cluster)] = cluster
        _install_handlers()
        if not _REG.atexit_registered:
            atexit.register(_cleanup_all)
            _REG.atexit_registered = True


def unregister(cluster: Closable) -> None:
    """A cluster is gone; the last one out restores the signal handlers."""
    with _REG.lock:
        _REG.live.pop(id(cluster), None)
        if not _REG.live:
            _restore_handlers()


@contextlib.contextmanager
def deferring_signals() -> Iterator[None]:
    """Run a clean-up with SIGINT/SIGTERM deferred to its end, then deliver the last one."""
    _REG.in_cleanup += 1
    try:
        yield
    finally:
        _REG.in_cleanup -= 1
    if _REG.in_cleanup == 0 and _REG.pending is not None:
        sig, _REG.pending = _REG.pending, None
        _redeliver(sig, None)


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

    Only names of the exact form EmulatedCluster creates are considered, and by default
    only those whose creating pid no longer exists, so concurrent runs (other processes,
    other users of the machine) are left alone. ``force`` also removes namespaces of live
    pids - use only when nothing else runs. Bridge namespaces go first: destroying them
    deletes every veth pair. Processes still inside a stale namespace are reported, not
    killed.
    """
    check_prefix(prefix)
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
