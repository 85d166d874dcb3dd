"""Start the ranks of a small job, on loopback or inside an :class:`EmulatedCluster`.

:func:`run_ranks` starts ``world_size`` copies of ``[sys.executable, *argv_tail]`` with
torchrun's ``env://`` contract (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``,
``MASTER_PORT``), so a rank only needs ``dist.init_process_group("gloo")``:

* ``cluster=None``: plain local processes, rendezvous at ``127.0.0.1`` on a free port,
  gloo bound to the loopback interface (``GLOO_SOCKET_IFNAME=lo``) so no traffic leaves
  the machine's loopback;
* an :class:`EmulatedCluster`: rank ``i`` runs in host ``i`` (its own namespace, shaped
  link, ``GLOO_SOCKET_IFNAME`` set by :meth:`EmulatedCluster.popen`), rendezvous at host
  0's address; the port can be fixed because host 0's namespace is fresh.

The launcher watches the ranks: when one exits non-zero, or the timeout passes, it stops
all of them (SIGTERM, then SIGKILL after a grace period) and raises :class:`RankFailed`
(or :class:`RanksTimedOut`) carrying the tail of the guilty rank's stderr.  Each rank's
stdout and stderr are collected by reader threads (no pipe can fill up and stall a rank);
``on_line`` sees every stdout line as it arrives, e.g. to drive a progress bar.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, Any

from .cluster import EmulatedCluster

__all__ = ["CompletedRank", "RankFailed", "RanksTimedOut", "run_ranks", "rank_env", "free_port", "EMULATED_PORT"]

#: Rank 0's port inside an emulated cluster (its namespace is fresh, nothing else listens).
EMULATED_PORT = 29500
#: Lines of a rank's stderr quoted in an error.
STDERR_TAIL_LINES = 30
_POLL_S = 0.05
_GRACE_S = 5.0

LineCallback = Callable[[int, str], None]


@dataclass(frozen=True)
class CompletedRank:
    """One rank that exited with status 0: its rank, exit code and captured output."""

    rank: int
    returncode: int
    stdout: str
    stderr: str


class RankFailed(RuntimeError):
    """A rank exited non-zero; every rank was stopped.

    Attributes:
        rank: the rank blamed (the first seen failing).
        returncode: its exit status (negative: killed by that signal).
        stderr_tail: the last lines of its stderr.
    """

    def __init__(self, rank: int, returncode: int | None, stderr_tail: str, message: str | None = None) -> None:
        self.rank = rank
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        super().__init__(message or f"rank {rank} {_describe_exit(returncode)}; all ranks were stopped.\n"
                         f"--- rank {rank} stderr (tail) ---\n{stderr_tail}")


class RanksTimedOut(RankFailed):
    """The ranks did not all finish within the timeout; every rank was stopped."""


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "did not finish"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(rank: int, world_size: int, master_addr: str, master_port: int) -> dict[str, str]:
    """torchrun's ``env://`` variables for one rank (one rank per host: ``LOCAL_RANK`` 0 in a cluster)."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
    }


class _Collector:
    """Reads one stream of one rank line by line in a daemon thread."""

    def __init__(self, rank: int, stream: IO[str], on_line: LineCallback | None) -> None:
        self.rank = rank
        self.lines: list[str] = []
        self._stream = stream
        self._on_line = on_line
        self.callback_error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"rank{rank}-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for line in self._stream:
            self.lines.append(line)
            if self._on_line is not None and self.callback_error is None:
                try:
                    self._on_line(self.rank, line.rstrip("\n"))
                except BaseException as exc:  # noqa: BLE001 - reported by the launcher
                    self.callback_error = exc
        self._stream.close()

    def join(self, timeout: float) -> str:
        self._thread.join(timeout)
        return "".join(self.lines)

    def tail(self, n: int = STDERR_TAIL_LINES) -> str:
        return "".join(self.lines[-n:])


@dataclass
class _Rank:
    rank: int
    proc: subprocess.Popen[str]
    out: _Collector
    err: _Collector


def _start_rank(
    rank: int,
    cluster: EmulatedCluster | None,
    argv: list[str],
    env: dict[str, str],
    on_line: LineCallback | None,
) -> _Rank:
    pipes: dict[str, Any] = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, "bufsize": 1}
    if cluster is None:
        proc = subprocess.Popen(argv, env={**os.environ, **env}, **pipes)
    else:
        proc = cluster.popen(rank, argv, env=env, **pipes)
    assert proc.stdout is not None and proc.stderr is not None
    return _Rank(rank, proc, _Collector(rank, proc.stdout, on_line), _Collector(rank, proc.stderr, None))


def _stop(ranks: Sequence[_Rank], grace_s: float = _GRACE_S) -> None:
    """SIGTERM every live rank, SIGKILL whatever is still alive after ``grace_s``."""
    alive = [r.proc for r in ranks if r.proc.poll() is None]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in alive:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _supervise(ranks: Sequence[_Rank], timeout: float) -> None:
    """Wait for all ranks; raise on the first failure, a failing callback, or the timeout."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [r.proc.poll() for r in ranks]
        failed = [r for r, code in zip(ranks, codes) if code not in (None, 0)]
        if failed:
            first = failed[0]
            _stop(ranks)
            first.err.join(2.0)  # let the reader drain what the rank wrote before exiting
            raise RankFailed(first.rank, codes[first.rank], first.err.tail())
        for r in ranks:
            if r.out.callback_error is not None:
                _stop(ranks)
                raise RuntimeError(f"on_line callback failed for rank {r.rank}") from r.out.callback_error
        if all(code == 0 for code in codes):
            return
        if time.monotonic() > deadline:
            _stop(ranks)
            slowest = next(r for r, code in zip(ranks, codes) if code is None)
            slowest.err.join(2.0)
            raise RanksTimedOut(
                slowest.rank, None, slowest.err.tail(),
                f"ranks did not finish within {timeout:g} s (rank {slowest.rank} still running); all ranks were "
                f"stopped.\n--- rank {slowest.rank} stderr (tail) ---\n{slowest.err.tail()}",
            )
        time.sleep(_POLL_S)


def run_ranks(
    cluster: EmulatedCluster | None,
    world_size: int,
    argv_tail: Sequence[str],
    env: Mapping[str, str] | None = None,
    timeout: float = 600.0,
    port: int | None = None,
    on_line: LineCallback | None = None,
) -> list[CompletedRank]:
    """Run ``world_size`` ranks of ``[sys.executable, *argv_tail]`` to completion.

    Args:
        cluster: a started :class:`EmulatedCluster` with at least ``world_size`` hosts
            (rank ``i`` in host ``i``), or ``None`` for loopback.
        world_size: number of ranks (>= 1).
        argv_tail: the interpreter's arguments, e.g. ``["-m", "pkg.worker", "cfg.json"]``.
        env: extra environment for every rank (added to this process's environment);
            the rendezvous variables always win.  ``OMP_NUM_THREADS`` defaults to 1.
        timeout: seconds until every rank is stopped and :class:`RanksTimedOut` raised.
        port: ``MASTER_PORT``; default a free loopback port, or :data:`EMULATED_PORT`.
        on_line: called as ``on_line(rank, line)`` for every stdout line, from a reader
            thread, while the ranks run (an exception in it stops the job).

    Returns:
        One :class:`CompletedRank` per rank, in rank order.

    Raises:
        RankFailed: a rank exited non-zero (message and ``stderr_tail`` hold its stderr).
        RanksTimedOut: the timeout passed.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if timeout <= 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    if cluster is not None and cluster.n_hosts < world_size:
        raise ValueError(f"cluster has {cluster.n_hosts} hosts, need one per rank ({world_size})")
    if cluster is None:
        addr, port = "127.0.0.1", port if port is not None else free_port()
    else:
        addr, port = cluster.host_addr(0), port if port is not None else EMULATED_PORT
    base = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR", **(env or {})}
    if cluster is None:
        base.setdefault("GLOO_SOCKET_IFNAME", "lo")
    argv = [sys.executable, *argv_tail]
    ranks: list[_Rank] = []
    try:
        for rank in range(world_size):
            rank_vars = rank_env(rank, world_size, addr, port)
            rank_vars["LOCAL_RANK"] = str(rank if cluster is None else 0)
            ranks.append(_start_rank(rank, cluster, argv, {**base, **rank_vars}, on_line))
        _supervise(ranks, timeout)
    except BaseException:
        _stop(ranks)  # KeyboardInterrupt, a failed start, or the failures above
        raise
    return [CompletedRank(r.rank, r.proc.returncode, r.out.join(10.0), r.err.join(10.0)) for r in ranks]
