"""A rank killed mid-training is restarted, and the job resumes without loss.

Two launchers restart a failed group: ``torchrun --max-restarts`` (run as a user would,
``python -m torch.distributed.run``) and ``flexcomm-train --max-restarts``.  Each test
SIGKILLs rank 1 once the run has passed a checkpoint; the launcher restarts the group,
the workers continue from the last checkpoint (model, optimizer, every rank's
error-feedback residuals, step counter, RNG, data position), and the final model equals
that of an uninterrupted run bit for bit.

Under torchrun every attempt shares the agent's TCPStore and ``MASTER_PORT``; the worker
joins through :func:`flexcomm.init_process_group`, whose per-attempt store keeps a
restarted rank from reading the dead attempt's gloo addresses (before it, 1 restart in 2
hung in gloo's ``connectFullMesh`` or was refused).
"""

from __future__ import annotations

import json
import re
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import flexcomm
from flexcomm import rendezvous
from flexcomm.launch import rank_pids
from flexcomm.train import checkpoint, cli
from flexcomm.train.records import RECORDS_FILE

#: The kill is sent once step 15 is logged; 75 more steps (~2 s on an idle machine) leave it
#: time to land before the run ends (with 15 more, a fast CI run once finished first).
STEPS, EVERY, KILL_AFTER = 90, 10, 15
ARGS = ["--dataset", "synthetic", "--train-subset", "512", "--test-subset", "64", "--net", "none",
        "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--eval-every", "20",
        "--compressor", "artopk-var", "--density", "0.05", "--threads", "1", "--timeout", "60", "--no-report"]
#: Seconds any one job may take on a loaded 2-core machine before the test calls it a hang.
JOB_TIMEOUT = 240


def prepare(run_dir: Path) -> Path:
    cfg, _ = cli.parse_config(ARGS + ["--out", str(run_dir)])
    return cfg.save(run_dir)


def torchrun(config: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "1", "--monitor-interval", "0.5", "-m", "flexcomm.train.worker", str(config)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def flexcomm_train(run_dir: Path) -> subprocess.Popen[str]:
    argv = [sys.executable, "-m", "flexcomm.train.cli", *ARGS, "--out", str(run_dir), "--max-restarts", "1"]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def steps_logged(run_dir: Path) -> int:
    path = run_dir / RECORDS_FILE
    return len(path.read_text().splitlines()) if path.exists() else 0


def kill_rank_after(job: subprocess.Popen[str], run_dir: Path, steps: int, rank: int = 1,
                    sig: signal.Signals = signal.SIGKILL) -> None:
    """Send ``sig`` to ``rank`` once rank 0 has logged ``steps`` steps."""
    deadline = time.monotonic() + JOB_TIMEOUT
    while steps_logged(run_dir) < steps:
        if job.poll() is not None:
            pytest.fail(f"the job ended before step {steps}:\n{job.stdout.read() if job.stdout else ''}")
        assert time.monotonic() < deadline, "no progress"
        time.sleep(0.05)
    victim = rank_pids("flexcomm.train.worker", str(run_dir / "config.json")).get(rank)
    assert victim is not None
    os.kill(victim, sig)


def resumed_from_a_checkpoint_before_the_end(output: str) -> bool:
    """Whether the restarted workers resumed from a checkpoint written before the last step
    (which one depends on how many steps ran between the kill's trigger and its arrival)."""
    found = re.search(r"resuming at step (\d+)", output)
    return found is not None and int(found.group(1)) in range(EVERY, STEPS, EVERY)


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    step = checkpoint.read_latest(run_dir)["step"]
    assert step == STEPS
    return checkpoint.load_rank(run_dir, 0, step)["model"]


def assert_resumed_exactly(run_dir: Path, reference: Path) -> None:
    """After the restart from the last checkpoint before the kill, the log holds every step
    once, and the model matches the uninterrupted run exactly."""
    steps = [json.loads(line)["step"] for line in (run_dir / RECORDS_FILE).read_text().splitlines()]
    assert steps == list(range(STEPS))
    expected, got = final_model(reference), final_model(run_dir)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An uninterrupted run of the same configuration."""
    config = prepare(tmp_path_factory.mktemp("restart") / "uninterrupted")
    job = torchrun(config)
    output = job.communicate(timeout=JOB_TIMEOUT)[0]
    assert job.returncode == 0, output
    return config.parent


def test_torchrun_restart_after_a_killed_rank_resumes_bitwise(reference: Path, tmp_path: Path) -> None:
    config = prepare(tmp_path / "killed")
    job = torchrun(config)
    kill_rank_after(job, config.parent, KILL_AFTER)
    output = job.communicate(timeout=JOB_TIMEOUT)[0]
    assert job.returncode == 0, output
    assert "exitcode: -9" in output  # torchrun saw the kill...
    assert resumed_from_a_checkpoint_before_the_end(output), output  # ...and the restarted workers resumed
    assert_resumed_exactly(config.parent, reference)


def test_flexcomm_train_max_restarts_resumes_bitwise(reference: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "killed"
    job = flexcomm_train(run_dir)
    kill_rank_after(job, run_dir, KILL_AFTER)
    output = job.communicate(timeout=JOB_TIMEOUT)[0]
    assert job.returncode == 0, output
    assert "restart 1 of 1" in output and resumed_from_a_checkpoint_before_the_end(output), output
    assert_resumed_exactly(run_dir, reference)


@pytest.mark.slow
def test_flexcomm_train_restarts_after_a_stopped_rank_times_out(reference: Path, tmp_path: Path) -> None:
    """SIGSTOP, not a crash: the peer fails at the process-group timeout, the launcher stops
    every rank (the stopped one too) and restarts the group, which resumes bitwise."""
    run_dir = tmp_path / "stopped"
    argv = [sys.executable, "-m", "flexcomm.train.cli", *ARGS, "--out", str(run_dir), "--max-restarts", "1"]
    argv[argv.index("--timeout") + 1] = "15"
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    kill_rank_after(job, run_dir, KILL_AFTER, sig=signal.SIGSTOP)
    output = job.communicate(timeout=JOB_TIMEOUT)[0]
    assert job.returncode == 0, output
    assert "restart 1 of 1" in output and resumed_from_a_checkpoint_before_the_end(output), output
    assert_resumed_exactly(run_dir, reference)


def _rank_behind_an_agent(rank: int, agent_port: int, out: Path) -> None:
    """One rank as torchrun starts it when the agent hosts the store; rank 0 comes late."""
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(agent_port), "TORCHELASTIC_USE_AGENT_STORE": "True"})
    if rank == 0:
        time.sleep(2)  # rank 1 reads the dead attempt's address first
    flexcomm.init_process_group("gloo", timeout=30)
    total = torch.tensor([rank + 1.0])
    torch.distributed.all_reduce(total)
    torch.distributed.destroy_process_group()
    (out / f"rank{rank}").write_text(str(total.item()))


def test_a_restarted_rank_skips_the_dead_attempts_store_address(tmp_path: Path) -> None:
    """The agent's store still names the store of an attempt whose rank 0 is dead: rank 1
    must not wait on it but find this attempt's store once rank 0 publishes it."""
    agent = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with socket.socket() as dead:  # a port nobody listens on any more
        dead.bind(("127.0.0.1", 0))
        dead_port = dead.getsockname()[1]
    agent.set(rendezvous.STORE_ADDRESS_KEY, f"127.0.0.1:{dead_port}")
    context = multiprocessing.get_context("spawn")
    ranks = [context.Process(target=_rank_behind_an_agent, args=(r, agent.port, tmp_path)) for r in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=120)
        assert process.exitcode == 0
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["3.0", "3.0"]


def test_init_process_group_takes_rank_and_world_from_the_environment() -> None:
    with pytest.raises(ValueError, match="takes rank, world_size from torchrun's environment"):
        flexcomm.init_process_group("gloo", rank=0, world_size=1)


def test_init_process_group_names_a_missing_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match="needs RANK in the environment"):
        flexcomm.init_process_group("gloo")


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
