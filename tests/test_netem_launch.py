"""Tests for flexcomm.netem.launch.run_ranks.

Loopback cases always run; the emulated case needs ``netem_available()`` (root, ip, tc,
working namespaces) and is skipped with the reason otherwise.
"""

from __future__ import annotations

import json
import time

import pytest

from flexcomm.netem import EmulatedCluster, netem_available
from flexcomm.netem.launch import CompletedRank, RankFailed, RanksTimedOut, run_ranks

# A rank that joins a gloo group via env://, allreduces its rank and reports what it saw.
ALLREDUCE = """
import json, os, torch, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
print(json.dumps({k: os.environ.get(k) for k in
      ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "GLOO_SOCKET_IFNAME", "OMP_NUM_THREADS",
       "EXTRA")} | {"sum": t.item()}), flush=True)
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
    done = run_ranks(None, 2, ["-c", ALLREDUCE], env={"EXTRA": "x"}, timeout=120)
    assert [r.rank for r in done] == [0, 1]
    assert all(r.returncode == 0 for r in done)
    reports = _reports(done)
    for rank, rep in enumerate(reports):
        assert rep["sum"] == 1.0
        assert (rep["RANK"], rep["WORLD_SIZE"], rep["LOCAL_RANK"]) == (str(rank), "2", str(rank))
        assert rep["MASTER_ADDR"] == "127.0.0.1"
        assert rep["GLOO_SOCKET_IFNAME"] == "lo"
        assert rep["OMP_NUM_THREADS"] == "1"
        assert rep["EXTRA"] == "x"
    assert reports[0]["MASTER_PORT"] == reports[1]["MASTER_PORT"]


def test_a_failing_rank_stops_the_others_and_reports_its_stderr() -> None:
    started = time.monotonic()
    with pytest.raises(RankFailed) as info:
        run_ranks(None, 3, ["-c", ONE_FAILS], timeout=100)
    assert time.monotonic() - started < 30  # the sleeping ranks were stopped, not awaited
    err = info.value
    assert err.rank == 1 and err.returncode == 3
    assert "something broke in rank one" in err.stderr_tail
    assert "something broke in rank one" in str(err)


def test_timeout_stops_every_rank() -> None:
    lines: list[tuple[int, str]] = []
    started = time.monotonic()
    with pytest.raises(RanksTimedOut):
        run_ranks(None, 2, ["-c", SLEEPS], timeout=3, on_line=lambda rank, line: lines.append((rank, line)))
    assert time.monotonic() - started < 20
    assert sorted(lines) == [(0, "started"), (1, "started")]


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        run_ranks(None, 0, ["-c", "pass"])
    with pytest.raises(ValueError):
        run_ranks(None, 1, ["-c", "pass"], timeout=0)


_AVAILABLE, _REASON = netem_available()


@pytest.mark.skipif(not _AVAILABLE, reason=f"network emulation unavailable: {_REASON}")
def test_emulated_ranks_rendezvous_at_host0_over_the_shaped_link() -> None:
    with EmulatedCluster(2, "1gbit", prefix="fcl") as cluster:
        done = run_ranks(cluster, 2, ["-c", ALLREDUCE], timeout=120)
        ifnames = [cluster.host_ifname(i) for i in range(2)]
    reports = _reports(done)
    for rank, rep in enumerate(reports):
        assert rep["sum"] == 1.0
        assert rep["MASTER_ADDR"] == "10.99.0.1"
        assert (rep["RANK"], rep["WORLD_SIZE"], rep["LOCAL_RANK"]) == (str(rank), "2", "0")
        assert rep["GLOO_SOCKET_IFNAME"] == ifnames[rank]
