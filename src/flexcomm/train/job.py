"""One ``flexcomm-train`` job: its worker ranks, its network, and who to blame when one fails.

Every rank is ``python -m flexcomm.train.worker RUN_DIR/config.json``, started by the one
launcher (:mod:`flexcomm.launch`) with torchrun's environment: on loopback for
``--net none``, else one rank per host of a :class:`flexcomm.netem.EmulatedCluster`. The
bandwidth schedule starts when rank 0 reports that every rank is ready to train (the
started marker), so start-up does not eat into the first phase, and stands still while rank 0
reports that the ranks evaluate (the evaluating marker): the link changes on training time, so
evaluating more often does not move training into later phases.  The rate changes really
applied, on that clock, are written to ``network.json``. With ``max_restarts`` a failed group is started
again (the workers resume from their last checkpoint); the network keeps its schedule.

A failing rank writes its error to ``error-rank<r>.json``. A rank that dies without writing
one (killed, crashed interpreter) is blamed first: the others' errors are then only the
consequence of losing a peer.
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from flexcomm.launch import Explain, RankFailed, describe_exit, run_ranks
from flexcomm.netem import EmulatedCluster, ScheduleRunner, parse_schedule
from flexcomm.train.config import CONFIG_FILE, TrainConfig
from flexcomm.train.records import NETWORK_FILE
from flexcomm.train.rank_files import EVALUATING_MARKER, STARTED_MARKER, error_file

__all__ = ["run_job", "explain_failure"]


def run_job(cfg: TrainConfig, run_dir: Path, max_restarts: int = 0) -> None:
    """Run every rank of ``cfg`` to completion; raise :class:`RankFailed` if the job fails."""
    _clear_markers(cfg, run_dir)
    argv = [sys.executable, "-m", "flexcomm.train.worker", str(run_dir / CONFIG_FILE)]
    common: dict[str, Any] = {
        "env": {"OMP_NUM_THREADS": str(cfg.threads)}, "timeout": None, "output": "inherit",
        "explain": explain_failure(run_dir, cfg.nproc), "max_restarts": max_restarts,
        "on_restart": lambda attempt, error: _clear_markers(cfg, run_dir),
    }  # fmt: skip
    try:
        if not parse_schedule(cfg.net):
            run_ranks(None, cfg.nproc, argv, **common)
            return
        with EmulatedCluster(cfg.nproc, cfg.net) as cluster:
            runners: list[ScheduleRunner] = []

            def start_schedule_once_training() -> None:
                if not runners and (run_dir / STARTED_MARKER).exists():
                    runners.append(cluster.start_schedule(paused=(run_dir / EVALUATING_MARKER).exists))

            try:
                run_ranks(cluster, cfg.nproc, argv, on_poll=start_schedule_once_training, **common)
            finally:
                for runner in runners:
                    runner.stop(raise_error=False)
                    _write_network(run_dir, cfg, runner)
            for runner in runners:
                runner.stop()  # re-raises a failed rate change: the run did not see its schedule
    finally:
        for marker in (STARTED_MARKER, EVALUATING_MARKER):
            (run_dir / marker).unlink(missing_ok=True)


def _clear_markers(cfg: TrainConfig, run_dir: Path) -> None:
    """A new attempt must not read the previous one's started marker or errors."""
    for stale in [run_dir / STARTED_MARKER, run_dir / EVALUATING_MARKER, *(error_file(run_dir, r) for r in range(cfg.nproc))]:
        stale.unlink(missing_ok=True)


def _write_network(run_dir: Path, cfg: TrainConfig, runner: ScheduleRunner) -> None:
    info: dict[str, Any] = {
        "schedule": cfg.net,
        "phases": [asdict(p) for p in runner.phases],
        "start_unix_time": runner.start_wall,
        # The changes' times are training time: the schedule stood still while the ranks evaluated.
        "clock": "training",
        "changes": [c._asdict() for c in runner.changes],
    }
    (run_dir / NETWORK_FILE).write_text(json.dumps(info, indent=2) + "\n")


def explain_failure(run_dir: Path, world_size: int) -> Explain:
    """The launcher's ``explain``: name the rank that failed first and why.

    Ranks still running may already have reported an error too (they write it before
    tearing down their process group), so every rank's report is considered.
    """

    def explain(failed: list[int], codes: list[int | None]) -> tuple[int, str]:
        errors = {r: e for r in range(world_size) if (e := _read_error(run_dir, r)) is not None}
        silent = [r for r in failed if r not in errors]
        if silent:
            rank = silent[0]
            return rank, (f"rank {rank} {describe_exit(codes[rank])} without reporting an error "
                          "(see its output above); all ranks were stopped")  # fmt: skip
        rank = min(errors, key=lambda r: errors[r]["time"])
        return rank, (f"rank {rank} failed: {errors[rank]['error']}\n"
                      f"(all ranks were stopped; full traceback in {error_file(run_dir, rank)})")  # fmt: skip

    return explain


def _read_error(run_dir: Path, rank: int) -> dict[str, Any] | None:
    try:
        return dict(json.loads(error_file(run_dir, rank).read_text()))
    except (FileNotFoundError, json.JSONDecodeError):
        return None
