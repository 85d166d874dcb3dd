"""Start the ranks of a run, watch them, and stop them all when one fails.

Every rank is the same program, ``python -m flexcomm.train.worker RUN_DIR/config.json``,
started as a subprocess with torchrun's environment variables (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``):

* plain loopback (``--net none``): N local processes, rendezvous on 127.0.0.1 at a
  free port;
* emulated network: one rank per host of a :class:`flexcomm.netem.EmulatedCluster`
  (its own network namespace, shaped link), rendezvous at host 0's address.  The
  bandwidth schedule starts when rank 0 reports that every rank is ready to train,
  so start-up does not eat into the first phase; the rate changes really applied
  are written to ``network.json``.

Subprocesses rather than ``torch.multiprocessing.spawn`` because the emulated ranks
must be started inside their namespaces (``ip netns exec``), and one code path for
both cases keeps them alike.  The launcher polls the ranks; when one exits non-zero
it terminates the others and raises :class:`RankFailed` with that rank's error
(which a rank writes to ``error-rank<r>.json``).  A rank that dies without writing
one (killed, crashed interpreter) is blamed first: the others' errors are then only
the consequence of losing a peer.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flexcomm.netem import EmulatedCluster, ScheduleRunner, parse_schedule
from flexcomm.train.config import CONFIG_FILE, TrainConfig
from flexcomm.train.records import NETWORK_FILE
from flexcomm.train.worker import STARTED_MARKER, error_file

#: Rank 0's port inside an emulated cluster: its namespace is fresh, so nothing else listens there.
EMULATED_PORT = 29500
_POLL_S = 0.1
_GRACE_S = 5.0


class RankFailed(RuntimeError):
    """A rank exited with an error; the message says which and why."""


def launch(cfg: TrainConfig, run_dir: Path) -> None:
    """Run every rank of ``cfg`` to completion; raise :class:`RankFailed` if any fails."""
    for stale in [run_dir / STARTED_MARKER, *(error_file(run_dir, r) for r in range(cfg.nproc))]:
        stale.unlink(missing_ok=True)
    argv = [sys.executable, "-m", "flexcomm.train.worker", str(run_dir / CONFIG_FILE)]
    try:
        if parse_schedule(cfg.net):
            _launch_emulated(cfg, run_dir, argv)
        else:
            _launch_local(cfg, run_dir, argv)
    finally:
        (run_dir / STARTED_MARKER).unlink(missing_ok=True)


def _rank_env(rank: int, cfg: TrainConfig, addr: str, port: int, local_rank: int) -> dict[str, str]:
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(cfg.nproc),
        "LOCAL_RANK": str(local_rank),
        "MASTER_ADDR": addr,
        "MASTER_PORT": str(port),
        "OMP_NUM_THREADS": str(cfg.threads),
        # c10d warns that it cannot resolve peers' host names; harmless and noisy.
        "TORCH_CPP_LOG_LEVEL": os.environ.get("TORCH_CPP_LOG_LEVEL", "ERROR"),
    }


def _launch_local(cfg: TrainConfig, run_dir: Path, argv: list[str]) -> None:
    port = _free_port()
    # Bind gloo to loopback explicitly: by default it uses whatever the host name resolves to.
    local = {"GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
    procs = [
        subprocess.Popen(argv, env={**os.environ, **local, **_rank_env(r, cfg, "127.0.0.1", port, r)})
        for r in range(cfg.nproc)
    ]
    supervise(procs, run_dir)


def _launch_emulated(cfg: TrainConfig, run_dir: Path, argv: list[str]) -> None:
    with EmulatedCluster(cfg.nproc, cfg.net) as cluster:
        procs = [
            cluster.popen(r, argv, env=_rank_env(r, cfg, cluster.host_addr(0), EMULATED_PORT, 0))
            for r in range(cfg.nproc)
        ]
        runners: list[ScheduleRunner] = []
        try:
            supervise(procs, run_dir, on_started=lambda: runners.append(cluster.start_schedule()))
        finally:
            for runner in runners:
                runner.stop(raise_error=False)
                _write_network(run_dir, cfg, runner)
        for runner in runners:
            runner.stop()  # re-raises a failed rate change: the run did not see its schedule


def _write_network(run_dir: Path, cfg: TrainConfig, runner: ScheduleRunner) -> None:
    info: dict[str, Any] = {
        "schedule": cfg.net,
        "phases": [asdict(p) for p in runner.phases],
        "start_unix_time": runner.start_wall,
        "changes": [c._asdict() for c in runner.changes],
    }
    (run_dir / NETWORK_FILE).write_text(json.dumps(info, indent=2) + "\n")


def _free_port() -> int:
    """A port free now; another process could take it before rank 0 binds it, which is rare
    enough on one machine to accept (rank 0 then fails to start and the job stops)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def supervise(
    procs: Sequence[subprocess.Popen[Any]], run_dir: Path, on_started: Callable[[], None] | None = None
) -> None:
    """Wait for every rank; on the first failure stop the rest and raise :class:`RankFailed`.

    ``on_started`` runs once, when rank 0 has created the started marker.
    """
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [r for r, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                _stop(procs)
                raise RankFailed(_describe_failure(run_dir, failed, codes, len(procs)))
            if all(code == 0 for code in codes):
                return
            if on_started is not None and (run_dir / STARTED_MARKER).exists():
                on_started()
                on_started = None
            time.sleep(_POLL_S)
    except BaseException:
        _stop(procs)  # KeyboardInterrupt, or the failure above: never leave ranks behind
        raise


def _stop(procs: Sequence[subprocess.Popen[Any]]) -> None:
    alive = [p for p in procs if p.poll() is None]
    for p in alive:
        p.terminate()
    deadline = time.monotonic() + _GRACE_S
    for p in alive:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _describe_failure(run_dir: Path, failed: list[int], codes: list[int | None], world_size: int) -> str:
    """Name the rank that failed first and why.

    Ranks still running may already have reported an error too (they write it before
    tearing down their process group), so every rank's report is considered.
    """
    errors = {r: e for r in range(world_size) if (e := _read_error(run_dir, r)) is not None}
    silent = [r for r in failed if r not in errors]
    if silent:
        rank = silent[0]
        code = codes[rank]
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        return f"rank {rank} {how} without reporting an error (see its output above); all ranks were stopped"
    rank = min(errors, key=lambda r: errors[r]["time"])
    error = errors[rank]
    return (
        f"rank {rank} failed: {error['error']}\n"
        f"(all ranks were stopped; full traceback in {error_file(run_dir, rank)})"
    )


def _read_error(run_dir: Path, rank: int) -> dict[str, Any] | None:
    try:
        return json.loads(error_file(run_dir, rank).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def worker_pids(config: Path) -> dict[int, int]:
    """rank -> pid of this machine's worker processes running ``config`` (read from /proc).

    For tools that watch a run from outside (fault injection, memory sampling), whoever
    launched it (flexcomm-train, torchrun, a cluster's namespaces).
    """
    found = {}
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            environ = (proc / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"flexcomm.train.worker" in cmdline and str(config).encode() in cmdline:
            for item in environ:
                if item.startswith(b"RANK="):
                    found[int(item[5:])] = int(proc.name)
    return found
