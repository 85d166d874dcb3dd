"""The one rank launcher: start N ranks of a command, watch them, stop them all on the first failure.

Used by ``flexcomm-train``, ``flexcomm-netem`` and the benchmarks. Every rank runs the same
``argv`` with torchrun's environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``,
``TORCHELASTIC_RESTART_COUNT``, ``TORCHELASTIC_MAX_RESTARTS``), so a rank only needs
``dist.init_process_group(backend)``:

* ``cluster=None``: local processes, rendezvous at ``127.0.0.1`` on a free port, gloo and
  NCCL bound to loopback (``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME`` ``lo`` unless set);
* an :class:`~flexcomm.netem.EmulatedCluster`: rank ``i`` in host ``i`` (its own namespace
  and shaped link; the cluster sets both interface variables), ``LOCAL_RANK`` 0,
  rendezvous at host 0's address on :data:`EMULATED_PORT` (a fresh namespace: it is free).
  All hosts share this machine and its GPUs: :data:`MACHINE_RANK_ENV` and
  :data:`MACHINE_RANKS_ENV` say where a rank stands on it, to pick a GPU by.

When a rank exits non-zero the launcher stops the others (SIGTERM, then SIGKILL) and
raises :class:`RankFailed` naming the rank and its exit code or signal (with its stderr
tail when output is captured or prefixed). SIGINT or SIGTERM sent to the launcher alone
stops every rank too, even when it was started with SIGINT ignored (a shell's background
job). With ``max_restarts`` a failed group is stopped and started again whole, like
torchrun, with ``TORCHELASTIC_RESTART_COUNT`` counting attempts; each attempt rendezvouses
on a port of its own, so no rank meets what a dead attempt left behind.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from flexcomm.stop_signals import signals_stop_ranks

if TYPE_CHECKING:  # the launcher runs without the emulator; only the type is needed here
    from flexcomm.netem import EmulatedCluster

__all__ = [
    "EMULATED_PORT", "OUTPUT_MODES", "RESTART_COUNT_ENV", "CompletedRank", "Explain", "RankFailed", "RankProcess",
    "RanksTimedOut", "describe_exit", "free_port", "rank_env", "rank_pids", "run_ranks", "start_ranks",
    "stop_processes", "stop_ranks", "supervise",
]  # fmt: skip

#: Rank 0's port inside an emulated cluster (plus the restart count: one port per attempt).
EMULATED_PORT = 29500
#: torchrun's name for the attempt counter (0 for the first attempt).
RESTART_COUNT_ENV = "TORCHELASTIC_RESTART_COUNT"
#: ``inherit``: ranks write to this process's stdout/stderr; ``capture``: kept for
#: :class:`CompletedRank`; ``prefix``: echoed line by line as ``[rank i] ...``.
OUTPUT_MODES = ("inherit", "capture", "prefix")
#: Lines of a rank's stderr quoted in an error.
STDERR_TAIL_LINES = 30
#: glibc malloc settings of every rank unless this process's environment sets them.  A
#: fixed mmap threshold (glibc's initial one, 128 KiB) stops glibc from raising it each time
#: a large block is freed; with it raised, later large tensors come from the heap, whose
#: free pages stay resident: a long run's ranks swung by +-4 MB and drifted up, while with
#: it fixed they rose ~1.3 MB in their first 10,000 steps (the bounded logs filling) and
#: stayed flat, at the same step rate (benchmarks/memory_growth.py, flex + auto, 16,000 steps).
MALLOC_ENV = {"MALLOC_MMAP_THRESHOLD_": "131072"}
_POLL_S = 0.05
_GRACE_S = 5.0

LineCallback = Callable[[int, str], None]
#: ``explain(failed_ranks, exit_codes) -> (rank to blame, message)``.
Explain = Callable[[list[int], list[int | None]], tuple[int, str]]


class RankFailed(RuntimeError):
    """A rank exited non-zero; every rank was stopped. ``rank``: the rank blamed; ``returncode``: its
    exit status (negative: killed by that signal; None: still running); ``stderr_tail``: its last
    stderr lines ("" when its output was inherited)."""

    def __init__(self, rank: int, returncode: int | None, message: str, stderr_tail: str = "") -> None:
        self.rank = rank
        self.returncode = returncode
        self.stderr_tail = stderr_tail
        super().__init__(message)


class RanksTimedOut(RankFailed):
    """The ranks did not all finish within the timeout; every rank was stopped."""


def describe_exit(code: int | None) -> str:
    """``exited with code 3`` / ``was killed by signal 9`` / ``did not finish``."""
    if code is None:
        return "did not finish"
    if code < 0:
        return f"was killed by signal {-code}"
    return f"exited with code {code}"


#: A rank's index among the ranks on its physical machine, and their number (emulated clusters only).
MACHINE_RANK_ENV = "FLEXCOMM_MACHINE_RANK"
MACHINE_RANKS_ENV = "FLEXCOMM_MACHINE_RANKS"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (rank 0 binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_env(
    rank: int, world_size: int, master_addr: str, master_port: int, *,
    ranks_per_host: int, restart_count: int = 0, max_restarts: int = 0,
) -> dict[str, str]:  # fmt: skip
    """torchrun's variables for one rank; hosts hold ``ranks_per_host`` consecutive ranks."""
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(rank % ranks_per_host),
        "LOCAL_WORLD_SIZE": str(ranks_per_host),
        "GROUP_RANK": str(rank // ranks_per_host),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        RESTART_COUNT_ENV: str(restart_count),
        "TORCHELASTIC_MAX_RESTARTS": str(max_restarts),
    }


@dataclass(frozen=True)
class CompletedRank:
    """One rank that exited with status 0: its rank, exit code and captured output."""

    rank: int
    returncode: int
    stdout: str
    stderr: str


class _LineReader:
    """Reads one output stream of one rank line by line in a daemon thread.

    Keeps every line (``keep_all``) or only the last :data:`STDERR_TAIL_LINES`, echoes each
    line as ``[rank i] line`` to ``echo`` when given, and passes it to ``on_line``.
    """

    _echo_lock = threading.Lock()  # whole lines from concurrent ranks, never interleaved

    def __init__(self, rank: int, stream: IO[str], keep_all: bool, echo: IO[str] | None,
                 on_line: LineCallback | None) -> None:  # fmt: skip
        self.rank = rank
        self.lines: deque[str] = deque(maxlen=None if keep_all else STDERR_TAIL_LINES)
        self.callback_error: BaseException | None = None
        self._stream, self._echo, self._on_line = stream, echo, on_line
        self._thread = threading.Thread(target=self._run, name=f"rank{rank}-reader", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        for line in self._stream:
            self.lines.append(line)
            if self._echo is not None:
                ending = "" if line.endswith("\n") else "\n"
                with self._echo_lock:
                    self._echo.write(f"[rank {self.rank}] {line}{ending}")
                    self._echo.flush()
            if self._on_line is not None and self.callback_error is None:
                try:
                    self._on_line(self.rank, line.rstrip("\n"))
                except BaseException as exc:  # noqa: BLE001 - reported by supervise
                    self.callback_error = exc
        self._stream.close()

    def text(self, timeout: float = 10.0, last: int | None = None) -> str:
        """What was kept (its ``last`` lines), once the stream has ended (or ``timeout`` passed)."""
        self._thread.join(timeout)
        return "".join(list(self.lines)[-last:] if last else self.lines)


@dataclass
class RankProcess:
    """One started rank: its process and, unless output is inherited, its stream readers."""

    rank: int
    proc: subprocess.Popen[Any]
    out: _LineReader | None = field(default=None, repr=False)
    err: _LineReader | None = field(default=None, repr=False)

    def stderr_tail(self) -> str:
        return self.err.text(2.0, last=STDERR_TAIL_LINES) if self.err is not None else ""


def start_ranks(
    argv: Sequence[str], world_size: int, *, cluster: EmulatedCluster | None = None,
    env: Mapping[str, str] | None = None, port: int | None = None, output: str = "inherit",
    on_line: LineCallback | None = None, stdin: int | None = None, restart_count: int = 0, max_restarts: int = 0,
) -> list[RankProcess]:  # fmt: skip
    """Start ``world_size`` ranks of ``argv`` (see the module doc for the environment).

    ``env`` is added to this process's environment (``OMP_NUM_THREADS`` defaults to 1, and
    :data:`MALLOC_ENV` to its values unless this process's environment sets them); the
    rendezvous variables always win. ``port`` is ``MASTER_PORT`` (default: a free loopback
    port, or :data:`EMULATED_PORT`), plus ``restart_count``. ``stdin=subprocess.PIPE`` gives
    each rank a pipe to talk to it. A rank that fails to start stops those already started.
    """
    if not argv:
        raise ValueError("argv must not be empty: give the command every rank runs")
    if output not in OUTPUT_MODES:
        raise ValueError(f"output must be one of {OUTPUT_MODES}, got {output!r}")
    _check_world(cluster, world_size)
    if cluster is None:  # a fresh port per attempt unless one is given
        addr, per_host = "127.0.0.1", world_size
        master_port = free_port() if port is None else port + restart_count
    else:
        addr, per_host = cluster.host_addr(0), 1
        master_port = (EMULATED_PORT if port is None else port) + restart_count
    base = {"OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR",
            **{name: os.environ.get(name, value) for name, value in MALLOC_ENV.items()}, **(env or {})}
    if cluster is None:  # by default gloo binds to whatever the host name resolves to
        for name in ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME"):
            base.setdefault(name, os.environ.get(name, "lo"))
    pipe = subprocess.PIPE if output != "inherit" else None
    ranks: list[RankProcess] = []
    try:
        for rank in range(world_size):
            rank_vars = rank_env(rank, world_size, addr, master_port, ranks_per_host=per_host,
                                 restart_count=restart_count, max_restarts=max_restarts)  # fmt: skip
            popen_args: dict[str, Any] = {"stdin": stdin, "stdout": pipe, "stderr": pipe, "text": True, "bufsize": 1}
            if cluster is None:
                proc = subprocess.Popen(list(argv), env={**os.environ, **base, **rank_vars}, **popen_args)
            else:
                machine = {MACHINE_RANK_ENV: str(rank), MACHINE_RANKS_ENV: str(world_size)}
                proc = cluster.popen(rank, argv, env={**base, **rank_vars, **machine}, **popen_args)
            ranks.append(_with_readers(rank, proc, output, on_line))
    except BaseException:
        stop_ranks(ranks)
        raise
    return ranks


def _check_world(cluster: EmulatedCluster | None, world_size: int) -> None:
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if cluster is not None and cluster.n_hosts < world_size:
        raise ValueError(f"cluster has {cluster.n_hosts} hosts, need one per rank ({world_size})")


def _with_readers(rank: int, proc: subprocess.Popen[Any], output: str, on_line: LineCallback | None) -> RankProcess:
    if output == "inherit":
        return RankProcess(rank, proc)
    assert proc.stdout is not None and proc.stderr is not None
    prefix = output == "prefix"
    return RankProcess(
        rank, proc,
        _LineReader(rank, proc.stdout, keep_all=not prefix, echo=sys.stdout if prefix else None, on_line=on_line),
        _LineReader(rank, proc.stderr, keep_all=not prefix, echo=sys.stderr if prefix else None, on_line=None),
    )  # fmt: skip


def stop_ranks(ranks: Sequence[RankProcess], grace_s: float = _GRACE_S) -> None:
    """SIGTERM every live rank, SIGKILL whatever is still alive after ``grace_s``."""
    stop_processes([r.proc for r in ranks], grace_s)


def stop_processes(procs: Sequence[subprocess.Popen[Any]], grace_s: float = _GRACE_S) -> None:
    """SIGTERM every live process, SIGKILL whatever is still alive after ``grace_s``."""
    alive = [proc for proc in procs if proc.poll() is None]
    for proc in alive:
        proc.terminate()
    deadline = time.monotonic() + grace_s
    for proc in alive:
        try:
            proc.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _blame(rank: RankProcess, what: str) -> str:
    """``rank R <what>; all ranks were stopped.`` plus its stderr tail when it was kept."""
    tail = rank.stderr_tail()
    quoted = f"\n--- rank {rank.rank} stderr (tail) ---\n{tail}" if tail else ""
    return f"rank {rank.rank} {what}; all ranks were stopped.{quoted}"


def supervise(
    ranks: Sequence[RankProcess], *, timeout: float | None = None,
    on_poll: Callable[[], None] | None = None, explain: Explain | None = None,
) -> None:  # fmt: skip
    """Wait for every rank; on the first failure (or the timeout) stop them all and raise.

    ``on_poll`` runs at every poll (e.g. to start a schedule once training starts);
    ``explain`` names the rank to blame and why (default: the first failed rank, its exit
    status and stderr tail). Anything raised here, a signal included, stops every rank.

    Raises:
        RankFailed: a rank exited non-zero, or an ``on_line`` callback failed.
        RanksTimedOut: ``timeout`` seconds passed first.
    """
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while True:
            codes = [r.proc.poll() for r in ranks]
            failed = [r.rank for r, code in zip(ranks, codes) if code not in (None, 0)]
            if failed:
                stop_ranks(ranks)
                rank, message = explain(failed, codes) if explain else _first_failed(ranks, failed, codes)
                raise RankFailed(rank, codes[rank], message, ranks[rank].stderr_tail())
            for r in ranks:
                if r.out is not None and r.out.callback_error is not None:
                    raise RuntimeError(f"on_line callback failed for rank {r.rank}") from r.out.callback_error
            if all(code == 0 for code in codes):
                return
            if deadline is not None and time.monotonic() > deadline:
                stop_ranks(ranks)
                slowest = ranks[codes.index(None)]
                raise RanksTimedOut(slowest.rank, None, _blame(slowest, f"still ran after {timeout:g} s"),
                                    slowest.stderr_tail())  # fmt: skip
            if on_poll is not None:
                on_poll()
            time.sleep(_POLL_S)
    except BaseException:
        stop_ranks(ranks)
        raise


def _first_failed(ranks: Sequence[RankProcess], failed: list[int], codes: list[int | None]) -> tuple[int, str]:
    """The default ``explain``: the first failed rank, its exit status and stderr tail."""
    return failed[0], _blame(ranks[failed[0]], describe_exit(codes[failed[0]]))


def run_ranks(
    cluster: EmulatedCluster | None, world_size: int, argv: Sequence[str], *,
    env: Mapping[str, str] | None = None, timeout: float | None = 600.0, port: int | None = None,
    output: str = "capture", on_line: LineCallback | None = None, on_poll: Callable[[], None] | None = None,
    explain: Explain | None = None, max_restarts: int = 0,
    on_restart: Callable[[int, RankFailed], None] | None = None,
) -> list[CompletedRank]:  # fmt: skip
    """Run ``world_size`` ranks of ``argv`` (the whole command) to completion; return them in rank order.

    ``cluster``: a started ``EmulatedCluster`` (one host per rank) or None for loopback;
    ``timeout``: seconds over all attempts (None: no limit); ``output``: one of
    :data:`OUTPUT_MODES` (the result's stdout/stderr are kept with ``capture`` only);
    ``on_line(rank, line)``: every stdout line, from a reader thread (not with ``inherit``;
    an exception in it stops the job); ``on_poll``, ``explain``: see :func:`supervise`;
    ``max_restarts``: how often a failed group is started again (a timeout or a signal
    never is), calling ``on_restart(next_attempt, error)`` first.
    """
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout}")
    if max_restarts < 0:
        raise ValueError(f"max_restarts must be >= 0, got {max_restarts}")
    deadline = None if timeout is None else time.monotonic() + timeout
    attempt = 0
    with signals_stop_ranks() as signals:
        while True:
            ranks: list[RankProcess] = []
            try:
                with signals.deferred():
                    ranks = start_ranks(argv, world_size, cluster=cluster, env=env, port=port, output=output,
                                        on_line=on_line, restart_count=attempt, max_restarts=max_restarts)  # fmt: skip
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                supervise(ranks, timeout=left, on_poll=on_poll, explain=explain)
            except RankFailed as exc:
                if isinstance(exc, RanksTimedOut) or attempt == max_restarts:
                    raise
                attempt += 1
                print(f"flexcomm launcher: {exc}\nflexcomm launcher: restarting every rank "
                      f"(restart {attempt} of {max_restarts})", file=sys.stderr, flush=True)  # fmt: skip
                if on_restart is not None:
                    on_restart(attempt, exc)
                continue
            except BaseException:
                stop_ranks(ranks)
                raise
            return [CompletedRank(r.rank, r.proc.returncode, r.out.text() if r.out else "",
                                  r.err.text() if r.err else "") for r in ranks]  # fmt: skip


def rank_pids(*cmdline_parts: str) -> dict[int, int]:
    """rank -> pid of processes whose command line holds every part, by their ``RANK`` (from /proc).

    For tools that watch a run from outside (fault injection, memory sampling), whoever launched it.
    """
    wanted = [part.encode() for part in cmdline_parts]
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if all(part in cmdline for part in wanted):
            for item in environ:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(proc.name)
    return found
