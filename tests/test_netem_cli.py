"""flexcomm-netem: a real 2-rank torch.distributed script on emulated hosts, its messages and its clean-up.

The emulated cases need root, ``ip``/``tc`` and working namespaces (``netem_available()``)
and are skipped with the reason otherwise; argument errors, the no-root message and the
loopback fallback run everywhere.
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

from flexcomm.netem import cli, netem_available

# Joins the group from torchrun's variables, allreduces, reports what it saw.
ALLREDUCE = """
import json, os, time, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(t)
time.sleep(float(os.environ.get("HOLD_S", "0")))
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
print(json.dumps({k: os.environ.get(k) for k in keys} | {"sum": t.item()}), flush=True)
dist.destroy_process_group()
"""
RANK1_FAILS = "import os, sys, time; os.environ['RANK'] == '1' and sys.exit(3); time.sleep(120)"
SLEEPS = "import os, time; print('started', os.getpid(), flush=True); time.sleep(120)"

_AVAILABLE, _REASON = netem_available()
needs_netem = pytest.mark.skipif(not _AVAILABLE, reason=f"network emulation unavailable: {_REASON}")


def _exit_of(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[object, str]:
    """Run cli.main(argv) in-process; return its exit code and stderr."""
    with pytest.raises(SystemExit) as info:
        cli.main(argv)
    return info.value.code, capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--nproc", "2", "--net", "100mbit"], "give the command every rank runs after '--'"),
        (["--nproc", "2", "--net", "100mbit", "--"], "give the command every rank runs after '--'"),
        (["--nproc", "0", "--net", "100mbit", "--", "true"], "--nproc must be in 1..254"),
        (["--nproc", "2", "--net", "100mbits", "--", "true"], "--net: bad rate '100mbits'"),
        (["--nproc", "2", "--net", "100mbit,1gbit", "--", "true"], "has no duration but is not the last phase"),
        (["--nproc", "2", "--net", "none", "--", "true"], "give a schedule to emulate"),
        (["--nproc", "2", "--net", "1gbit", "--timeout", "0", "--", "true"], "--timeout must be > 0"),
        (["--net", "1gbit", "--", "true"], "--nproc"),
    ],
)
def test_bad_arguments_say_what_is_wrong(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _exit_of(argv, capsys)
    assert code == 2 and message in err


def test_without_root_it_says_root_and_ip_tc_are_needed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "netem_available", lambda: (False, "creating network namespaces needs root"))
    code, _ = _exit_of(["--nproc", "2", "--net", "100mbit", "--", sys.executable, "-c", "pass"], capsys)
    assert isinstance(code, str)  # SystemExit(message): exit status 1, message on stderr
    assert "needs root" in code and "'ip' and 'tc'" in code and "--loopback" in code


def test_loopback_runs_the_command_with_prefixed_output(capfd: pytest.CaptureFixture[str]) -> None:
    cli.main(["--nproc", "2", "--net", "100mbit", "--loopback", "--", sys.executable, "-c", ALLREDUCE])
    out, err = capfd.readouterr()
    reports = {line.split("] ", 1)[0]: json.loads(line.split("] ", 1)[1]) for line in out.splitlines()}
    assert sorted(reports) == ["[rank 0", "[rank 1"]
    assert all(r["sum"] == 3.0 and r["MASTER_ADDR"] == "127.0.0.1" for r in reports.values())
    assert "the schedule is NOT applied" in err


def test_a_failing_rank_gives_its_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = _exit_of(["--nproc", "2", "--net", "1gbit", "--loopback", "--", sys.executable, "-c", RANK1_FAILS],
                         capsys)  # fmt: skip
    assert code == 3 and "rank 1 exited with code 3; all ranks were stopped" in err


def test_a_missing_program_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    code, _ = _exit_of(["--nproc", "1", "--net", "1gbit", "--loopback", "--", "no-such-program-xyz"], capsys)
    assert isinstance(code, str) and "no-such-program-xyz" in code


# -- emulated hosts (root) ----------------------------------------------------------------
def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-m", "flexcomm.netem.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **(env or {})})  # fmt: skip


def _namespaces_of(pid: int) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith(f"fc{pid}-")]


@needs_netem
def test_a_torch_script_runs_on_emulated_hosts_under_the_schedule(tmp_path: Path) -> None:
    changes = tmp_path / "changes.jsonl"
    job = _cli("--nproc", "2", "--net", "100mbit:1s,50mbit/2ms", "--log-changes", str(changes), "--",
               sys.executable, "-c", ALLREDUCE, env={"HOLD_S": "3"})  # fmt: skip
    out, err = job.communicate(timeout=240)
    assert job.returncode == 0, err
    reports = sorted(out.splitlines())
    assert [line[:8] for line in reports] == ["[rank 0]", "[rank 1]"]
    for rank, line in enumerate(reports):
        rep = json.loads(line.split("] ", 1)[1])
        assert rep["sum"] == 3.0 and rep["MASTER_ADDR"] == "10.99.0.1"
        assert (rep["RANK"], rep["WORLD_SIZE"], rep["LOCAL_RANK"]) == (str(rank), "2", "0")
        assert rep["GLOO_SOCKET_IFNAME"] == rep["NCCL_SOCKET_IFNAME"] == f"fc{job.pid}h{rank}"
    logged = [json.loads(line) for line in changes.read_text().splitlines()]
    assert [(c["rate_bps"], c["delay_s"]) for c in logged] == [(1e8, 0.0), (5e7, 0.002)]
    assert logged[0]["time_s"] < logged[1]["time_s"]
    assert _namespaces_of(job.pid) == []


@needs_netem
def test_a_failed_rank_leaves_nothing_behind() -> None:
    job = _cli("--nproc", "2", "--net", "1gbit", "--", sys.executable, "-c", RANK1_FAILS)
    _, err = job.communicate(timeout=120)
    assert job.returncode == 3 and "rank 1 exited with code 3" in err
    assert _namespaces_of(job.pid) == []


@needs_netem
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_stops_the_ranks_and_removes_the_network(sig: signal.Signals) -> None:
    job = _cli("--nproc", "2", "--net", "1gbit/1ms", "--", sys.executable, "-c", SLEEPS)
    assert job.stdout is not None
    pids = [int(job.stdout.readline().split()[-1]) for _ in range(2)]
    assert len(_namespaces_of(job.pid)) == 3  # bridge + 2 hosts
    job.send_signal(sig)  # the launcher alone, as `kill` would
    job.wait(60)
    assert job.returncode != 0
    assert _namespaces_of(job.pid) == []
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids)
