"""Shared by the reliability benchmarks (restart.py, chaos.py): a small training job under
torchrun, on loopback or across emulated hosts, that a benchmark can hurt and then judge.

A job is ``python -m flexcomm.train.worker RUN_DIR/config.json`` under torchrun, as the
README's multi-node recipe starts it:

* ``loopback``: one agent, ``--standalone --nproc-per-node 2``;
* ``emulated``: two :class:`flexcomm.netem.EmulatedCluster` hosts, one agent on each
  (``--nnodes 2``, c10d rendezvous at host 0), so the restart runs the multi-node path.

:func:`judge` sorts an ended job into ``ok`` (exit 0, every step logged once, the final
model bitwise equal to an uninterrupted run's), ``wrong`` (exit 0 but a step missing or a
different model: a silent wrong result), ``error`` (non-zero exit, every rank ended) or
``hang`` (not ended within the benchmark's limit; then killed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch

from flexcomm.launch import rank_pids
from flexcomm.netem import EmulatedCluster
from flexcomm.train import checkpoint, cli
from flexcomm.train.records import RECORDS_FILE, read_records

RESULTS = Path(__file__).resolve().parent / "results"
RDZV_PORT = 29400


def training_args(steps: int, every: int, timeout_s: float) -> list[str]:
    """A small run (2 ranks, synthetic data, AR-Topk VAR with error feedback) with checkpoints."""
    return ["--dataset", "synthetic", "--train-subset", "512", "--test-subset", "64", "--net", "none",
            "--steps", str(steps), "--checkpoint-every", str(every), "--eval-every", str(every),
            "--compressor", "artopk-var", "--density", "0.05", "--threads", "1", "--timeout", str(timeout_s),
            "--no-report"]  # fmt: skip


def prepare(run_dir: Path, args: list[str]) -> Path:
    """Write ``run_dir/config.json`` for ``args``; return its path."""
    cfg, _ = cli.parse_config([*args, "--out", str(run_dir)])
    return cfg.save(run_dir)


@dataclass
class Job:
    """The torchrun agents of one run (one per host) and their combined output file."""

    config: Path
    agents: list[subprocess.Popen[Any]]
    log: IO[str]
    started: float = field(default_factory=time.monotonic)

    @property
    def run_dir(self) -> Path:
        return self.config.parent

    def ended(self) -> bool:
        return all(a.poll() is not None for a in self.agents)

    def returncode(self) -> int:
        """0 if every agent succeeded, else the first non-zero code."""
        return next((a.returncode for a in self.agents if a.returncode), 0)

    def worker_pids(self) -> dict[int, int]:
        return rank_pids("flexcomm.train.worker", str(self.config))

    def kill(self) -> None:
        """SIGKILL the agents' process groups and every worker of this run (torchrun starts
        workers in sessions of their own)."""
        for agent in self.agents:
            if agent.poll() is None:
                _signal_group(agent.pid, signal.SIGKILL)
        for pid in self.worker_pids().values():
            _signal(pid, signal.SIGKILL)
        for agent in self.agents:
            agent.wait()
        self.log.close()


def start(config: Path, cluster: EmulatedCluster | None, max_restarts: int, log_path: Path, port: int = RDZV_PORT) -> Job:
    """Start the agents of ``config`` (loopback when ``cluster`` is None; ``port``: the emulated
    rendezvous's); agents and ranks all write to ``log_path``."""
    log = open(log_path, "w")
    worker = ["-m", "flexcomm.train.worker", str(config)]
    common = [sys.executable, "-m", "torch.distributed.run", "--max-restarts", str(max_restarts),
              "--monitor-interval", "0.5"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    popen = {"stdout": log, "stderr": subprocess.STDOUT, "text": True, "start_new_session": True}
    if cluster is None:
        argv = [*common, "--standalone", "--nproc-per-node", "2", *worker]
        agents = [subprocess.Popen(argv, env={**env, "GLOO_SOCKET_IFNAME": "lo"}, **popen)]
    else:
        endpoint = f"{cluster.host_addr(0)}:{port}"
        agents = [
            cluster.popen(host, [*common, "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                 "--rdzv-endpoint", endpoint, "--rdzv-id", config.parent.name,
                                 "--rdzv-conf", f"is_host={int(host == 0)}", "--local-addr", cluster.host_addr(host),
                                 *worker], env=env, **popen)  # fmt: skip
            for host in range(2)
        ]
    return Job(config, agents, log)


def last_step(run_dir: Path) -> int:
    """The last step rank 0 logged (-1: none yet)."""
    done = read_records(run_dir)
    return done[-1]["step"] if done else -1


def wait_for_step(job: Job, step: int, limit_s: float) -> bool:
    """Wait until the job logged ``step``; False if it ended or ``limit_s`` passed first."""
    deadline = time.monotonic() + limit_s
    while last_step(job.run_dir) < step:
        if job.ended() or time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def wait_for_resume(job: Job, old_rank0_pid: int | None, limit_s: float) -> float | None:
    """Seconds until a restarted rank 0 logged its first step; None if it never did.

    The restarted rank 0 is a new process; its first step is the first record it writes
    (the log's mtime moves past the moment the new process was seen) at the checkpoint
    it resumed from.
    """
    started = time.monotonic()
    deadline = started + limit_s
    new_pid = None
    while new_pid is None or new_pid == old_rank0_pid:
        if job.ended() or time.monotonic() > deadline:
            return None
        new_pid = job.worker_pids().get(0)
        time.sleep(0.02)
    seen = time.time()
    path = job.run_dir / RECORDS_FILE
    while time.monotonic() < deadline and not job.ended():
        with contextlib.suppress(FileNotFoundError, checkpoint.CheckpointError):
            resumed_from = checkpoint.read_latest(job.run_dir)["step"]
            if path.stat().st_mtime > seen and last_step(job.run_dir) >= resumed_from:
                return time.monotonic() - started
        time.sleep(0.02)
    return None


def wait_to_end(job: Job, limit_s: float) -> bool:
    """Wait for every agent to exit; on ``limit_s`` kill the job and return False (a hang)."""
    deadline = job.started + limit_s
    while not job.ended():
        if time.monotonic() > deadline:
            job.kill()
            return False
        time.sleep(0.1)
    job.log.close()
    return True


def final_model(run_dir: Path) -> dict[str, torch.Tensor] | None:
    try:
        latest = checkpoint.read_latest(run_dir)
        return checkpoint.load_rank(run_dir, 0, latest["step"])["model"]
    except checkpoint.CheckpointError:
        return None


def judge(job: Job, ended: bool, steps: int, reference: dict[str, torch.Tensor]) -> str:
    """``ok`` / ``wrong`` / ``error`` / ``hang``, as in the module docstring."""
    if not ended:
        return "hang"
    if job.returncode() != 0:
        return "error"
    logged = [r["step"] for r in read_records(job.run_dir)]
    model = final_model(job.run_dir)
    same = model is not None and model.keys() == reference.keys() and all(
        torch.equal(model[k], reference[k]) for k in reference
    )
    return "ok" if logged == list(range(steps)) and same else "wrong"


def reference_model(root: Path, args: list[str], limit_s: float) -> dict[str, torch.Tensor]:
    """The final model of an uninterrupted loopback run of ``args``."""
    config = prepare(root / "reference", args)
    job = start(config, None, 0, root / "reference.log")
    if not wait_to_end(job, limit_s) or job.returncode() != 0:
        raise SystemExit(f"the uninterrupted reference run failed; see {root / 'reference.log'}")
    model = final_model(config.parent)
    assert model is not None
    return model


def _signal_group(pid: int, sig: int) -> None:
    try:
        os.killpg(pid, sig)
    except ProcessLookupError:
        pass


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass
