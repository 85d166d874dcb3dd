"""Tests for the one rank launcher, flexcomm.launch.

Loopback cases always run; the emulated case needs ``netem_available()`` (root, ip, tc,
working namespaces) and is skipped with the reason otherwise.
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

from flexcomm.netem import EmulatedCluster, netem_available
from flexcomm.launch import CompletedRank, RankFailed, RanksTimedOut, run_ranks

# A rank that joins a gloo group via env://, allreduces its rank and reports what it saw.
ALLREDUCE = """
import json, os, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(json.dumps({k: os.environ.get(k) for k in
      ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
       "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "OMP_NUM_THREADS", "TORCHELASTIC_RESTART_COUNT",
       "EXTRA", "MALLOC_MMAP_THRESHOLD_", "NCCL_P2P_DISABLE", "NCCL_SHM_DISABLE", "NCCL_IB_DISABLE")} | {"sum": t.item()}), flush=True)
dist.destroy_process_group()
"""

# Rank 1 fails at once; the others would wait forever.
ONE_FAILS = """
import os, sys, time
if os.environ["RANK"] == "1":
    print("something broke in rank one", file=sys.stderr, flush=True)
    sys.exit(3)
time.sleep(120)
"""

SLEEPS = "import time; print('started', flush=True); time.sleep(120)"


def _reports(done: list[CompletedRank]) -> list[dict]:
    return [json.loads(r.stdout.strip().splitlines()[-1]) for r in done]


def test_loopback_ranks_form_a_group_with_torchrun_env() -> None:
    done = run_ranks(None, 2, [sys.executable, "-c", ALLREDUCE], env={"EXTRA": "x"}, timeout=120)
    assert [r.rank for r in done] == [0, 1]
    assert all(r.returncode == 0 for r in done)
    reports = _reports(done)
    for rank, rep in enumerate(reports):
        assert rep["sum"] == 1.0
        assert (rep["RANK"], rep["WORLD_SIZE"], rep["LOCAL_RANK"]) == (str(rank), "2", str(rank))
        assert (rep["LOCAL_WORLD_SIZE"], rep["GROUP_RANK"], rep["TORCHELASTIC_RESTART_COUNT"]) == ("2", "0", "0")
        assert rep["MASTER_ADDR"] == "127.0.0.1"
        assert rep["GLOO_SOCKET_IFNAME"] == rep["NCCL_SOCKET_IFNAME"] == "lo"
        assert rep["OMP_NUM_THREADS"] == "1"
        assert rep["EXTRA"] == "x"
        assert rep["MALLOC_MMAP_THRESHOLD_"] == "131072"  # fixed, so long runs stay flat in memory
    assert reports[0]["MASTER_PORT"] == reports[1]["MASTER_PORT"]


def test_the_users_malloc_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    done = run_ranks(None, 2, [sys.executable, "-c", ALLREDUCE], timeout=120)
    assert [rep["MALLOC_MMAP_THRESHOLD_"] for rep in _reports(done)] == ["65536", "65536"]


def test_a_failing_rank_stops_the_others_and_reports_its_stderr() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(None, 3, [sys.executable, "-c", ONE_FAILS], timeout=100)
    assert time.monotonic() - started < 30  # the sleeping ranks were stopped, not awaited
    err = info.value
    assert err.rank == 1 and err.returncode == 3
    assert "something broke in rank one" in err.stderr_tail
    assert "something broke in rank one" in str(err)


def test_timeout_stops_every_rank() -> None:
    lines: list[tuple[int, str]] = []
    started = time.monotonic()
    with pytest.raises(RanksTimedOut):
        run_ranks(None, 2, [sys.executable, "-c", SLEEPS], timeout=3, on_line=lambda rank, line: lines.append((rank, line)))
    assert time.monotonic() - started < 20
    assert sorted(lines) == [(0, "started"), (1, "started")]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        run_ranks(None, 0, [sys.executable, "-c", "pass"])
    with pytest.raises(ValueError):
        run_ranks(None, 1, [sys.executable, "-c", "pass"], timeout=0)


_AVAILABLE, _REASON = netem_available()


@pytest.mark.skipif(not _AVAILABLE, reason=f"network emulation unavailable: {_REASON}")
def test_emulated_ranks_rendezvous_at_host0_over_the_shaped_link() -> None:
    with EmulatedCluster(2, "1gbit", prefix="fcl") as cluster:
        done = run_ranks(cluster, 2, [sys.executable, "-c", ALLREDUCE], timeout=120)
        ifnames = [cluster.host_ifname(i) for i in range(2)]
    reports = _reports(done)
    for rank, rep in enumerate(reports):
        assert rep["sum"] == 1.0
        assert rep["MASTER_ADDR"] == "10.99.0.1"
        assert (rep["RANK"], rep["WORLD_SIZE"], rep["LOCAL_RANK"]) == (str(rank), "2", "0")
        assert (rep["LOCAL_WORLD_SIZE"], rep["GROUP_RANK"]) == ("1", str(rank))
        assert rep["GLOO_SOCKET_IFNAME"] == rep["NCCL_SOCKET_IFNAME"] == ifnames[rank]
        # NCCL's P2P/SHM/IB transports would bypass the shaped link between namespaces.
        assert rep["NCCL_P2P_DISABLE"] == rep["NCCL_SHM_DISABLE"] == rep["NCCL_IB_DISABLE"] == "1"


# Attempt 0: one allreduce, then rank 1 dies while rank 0 waits in the next one.
# Attempt 1: every rank meets again (fresh rendezvous) and finishes.
FAILS_ONCE = """
import os, sys, torch, torch.distributed as dist
dist.init_process_group("gloo")
t = torch.ones(1)
dist.all_reduce(t)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
if attempt == 0 and dist.get_rank() == 1:
    os._exit(3)
dist.all_reduce(t)
print(attempt, os.environ["MASTER_PORT"], t.item(), flush=True)
dist.destroy_process_group()
"""


def test_a_failed_group_is_restarted_whole_with_the_attempt_count() -> None:
    restarts: list[tuple[int, int, int | None]] = []
    done = run_ranks(None, 2, [sys.executable, "-c", FAILS_ONCE], timeout=120, max_restarts=2,
                     on_restart=lambda attempt, err: restarts.append((attempt, err.rank, err.returncode)))
    assert restarts == [(1, 1, 3)]
    lines = [r.stdout.split() for r in done]
    assert [line[0] for line in lines] == ["1", "1"] and lines[0][1] == lines[1][1]
    assert [line[2] for line in lines] == ["4.0", "4.0"]


def test_restarts_run_out_with_the_last_failure() -> None:
    attempts: list[int] = []
    with pytest.raises(RankFailed, match="rank 1 exited with code 3") as info:
        run_ranks(None, 3, [sys.executable, "-c", ONE_FAILS], timeout=100, max_restarts=1,
                  on_restart=lambda attempt, err: attempts.append(attempt))
    assert attempts == [1] and info.value.returncode == 3


def test_prefixed_output_names_the_rank(capsys: pytest.CaptureFixture[str]) -> None:
    code = "import os, sys; print('out', os.environ['RANK']); print('err', os.environ['RANK'], file=sys.stderr)"
    done = run_ranks(None, 2, [sys.executable, "-c", code], timeout=60, output="prefix")
    out, err = capsys.readouterr()
    assert sorted(out.splitlines()) == ["[rank 0] out 0", "[rank 1] out 1"]
    assert sorted(err.splitlines()) == ["[rank 0] err 0", "[rank 1] err 1"]
    assert [r.returncode for r in done] == [0, 0]


def test_bad_output_mode_and_empty_command() -> None:
    with pytest.raises(ValueError, match="output must be one of"):
        run_ranks(None, 1, [sys.executable, "-c", "pass"], output="loud")
    with pytest.raises(ValueError, match="argv must not be empty"):
        run_ranks(None, 1, [])
    with pytest.raises(ValueError, match="max_restarts must be >= 0"):
        run_ranks(None, 1, [sys.executable, "-c", "pass"], max_restarts=-1)


# A launcher that ignores SIGINT, as a shell's background job does, running two sleeping ranks.
LAUNCHER = """
import signal, sys
signal.signal(signal.SIGINT, signal.SIG_IGN)
from flexcomm.launch import run_ranks
rank = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
run_ranks(None, 2, [sys.executable, "-c", rank], timeout=None, on_line=lambda r, pid: print(pid, flush=True))
"""


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_lone_signal_to_the_launcher_stops_every_rank(sig: signal.Signals) -> None:
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    assert launcher.stdout is not None
    pids = [int(launcher.stdout.readline()) for _ in range(2)]
    launcher.send_signal(sig)  # the launcher only, not its process group
    assert launcher.wait(60) != 0
    deadline = time.monotonic() + 10
    while not all(map(_gone, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert all(map(_gone, pids))


def test_the_error_quotes_only_the_last_stderr_lines() -> None:
    code = "import sys; [print('line', i, file=sys.stderr) for i in range(100)]; sys.exit(2)"
    with pytest.raises(RankFailed) as info:
        run_ranks(None, 1, [sys.executable, "-c", code], timeout=60)
    assert info.value.stderr_tail.splitlines() == [f"line {i}" for i in range(70, 100)]


def test_a_signal_while_ranks_start_is_raised_once_they_are_known() -> None:
    # CI caught SIGINT landing while rank 1's output readers were starting: rank 1 was not yet
    # in the launcher's list and outlived it.  Inside ``deferred`` the signal waits for the block.
    from flexcomm.stop_signals import StopSignals

    signals = StopSignals()
    started = []
    with pytest.raises(SystemExit) as info:
        with signals.deferred():
            signals.handle(signal.SIGTERM, None)
            started.append("rank 1")  # the block finishes first
    assert started == ["rank 1"] and info.value.code == 128 + signal.SIGTERM
    with pytest.raises(KeyboardInterrupt):
        signals.handle(signal.SIGINT, None)  # outside the block: at once
    with signals.deferred():
        pass  # nothing pending any more
