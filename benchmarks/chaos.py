"""Chaos: random faults at random points of a training run; each must end in a resumed,
complete, bitwise-correct run or in a clear error, never in a hang or a silent wrong result.

    sudo .venv/bin/python benchmarks/chaos.py                    # 3 trials of each fault
    sudo .venv/bin/python benchmarks/chaos.py --trials 1 --faults kill,link-down
    sudo .venv/bin/python benchmarks/chaos.py --max-restarts 0 --faults stop,kill --trials 2 --name chaos_no_restart

Every trial runs the small job of ``benchmarks/faults.py`` across two emulated hosts
under torchrun (one agent per host, ``--max-restarts 1``, process-group timeout
``--pg-timeout`` seconds) and injects one fault into a random rank at a random step:

* ``kill`` / ``stop``: SIGKILL or SIGSTOP the rank at a random moment of a step;
* ``kill-collective`` / ``stop-collective``: the same, once a stack sample shows the rank
  inside the hook's collectives;
* ``kill-checkpoint`` / ``stop-checkpoint``: the same, once the rank has started writing a
  checkpoint (its temporary file or its new file appeared);
* ``link-down``: the rank's link down for 3-8 s, then up again;
* ``1mbit``: every link at 1 Mbit/s for 5-10 s, then back to 1 Gbit/s.

Where the rank was when hit is read from its own stacks: just before the signal the
benchmark sends SIGUSR1, on which the worker prints every thread's stack (faulthandler),
and the main thread's innermost flexcomm/torch frames name the phase (backward, the hook's
collectives, checkpoint, ...).  A stopped rank stays stopped: its peers must fail at the
process-group timeout and torchrun must then stop and restart the group.  Outcomes are
judged as in ``faults.judge``; a trial still running after ``--limit`` seconds is a hang.
With ``--max-restarts 0`` a fault that stops the job must end it in an error that every
rank still alive reports (its ``error-rank<r>.json``), soon after the process-group timeout.
Writes ``benchmarks/results/chaos.{csv,json,png}``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import faults  # noqa: E402

from flexcomm.netem import EmulatedCluster  # noqa: E402
from flexcomm.train import checkpoint  # noqa: E402
from flexcomm.train.rank_files import error_file  # noqa: E402

STEPS, EVERY = 30, 10
#: The victim ended (the run finished) before the moment the fault waited for came.
MISSED = "the rank ended first"
NOT_INJECTED = "not injected"
#: How faulthandler heads each thread's stack.
STACKS = "(most recent call first)"
FAULTS = ("kill", "stop", "kill-collective", "stop-collective", "kill-checkpoint", "stop-checkpoint", "link-down", "1mbit")
#: The main thread's frames, innermost first, that name the phase a rank was in.
PHASES = (
    ("checkpoint", re.compile(r"train/checkpoint\.py|in _save$|in _load_newest_usable$")),
    ("hook collectives", re.compile(r"flexcomm/(hook|state|exchange/|comm/)|train/(timed_hook|baselines)\.py")),
    ("backward", re.compile(r"in backward$|autograd/")),
    ("evaluation", re.compile(r"in evaluate$")),
    ("forward / optimizer", re.compile(r"in _train_step$")),
    ("start-up", re.compile(r"in (__init__|run_rank)$")),
)


def inject(kind: str, job: faults.Job, cluster: EmulatedCluster, victim: int, rng: random.Random,
           job_log: Path) -> str:
    """Hurt ``victim`` (or the network); return a note of what was done."""
    if kind in ("link-down", "1mbit"):
        seconds = rng.uniform(3, 8) if kind == "link-down" else rng.uniform(5, 10)
        if kind == "link-down":
            _link(cluster, victim, "down")
        else:
            cluster.set_rate(1e6)
        time.sleep(seconds)
        if kind == "link-down":
            _link(cluster, victim, "up")
        else:
            cluster.set_rate(1e9)
        return f"{seconds:.1f} s"
    pid = job.worker_pids()[victim]
    try:
        if kind.endswith("checkpoint"):
            _wait_for_checkpoint_write(job, victim)
            printed = _print_stacks(pid, job_log)
        elif kind.endswith("collective"):
            printed = _sample_until_in_collectives(pid, job_log, rng)
        else:
            time.sleep(rng.uniform(0, 0.3))  # a random moment of the step
            printed = _print_stacks(pid, job_log)
        os.kill(pid, signal.SIGKILL if kind.startswith("kill") else signal.SIGSTOP)
    except ProcessLookupError:
        return MISSED
    return f"pid {pid}" + ("" if printed else ", stacks not printed within 2 s")


def _print_stacks(pid: int, job_log: Path, limit_s: float = 2.0) -> bool:
    """SIGUSR1: the rank prints its stacks; wait until they are in the log (on a loaded
    machine the handler can take a moment to run)."""
    before = job_log.read_text(errors="replace").count(STACKS)
    os.kill(pid, signal.SIGUSR1)
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if job_log.read_text(errors="replace").count(STACKS) > before:
            time.sleep(0.005)  # the rest of the dump (other threads follow within microseconds)
            return True
        time.sleep(0.002)
    return False


def _sample_until_in_collectives(pid: int, job_log: Path, rng: random.Random, tries: int = 100) -> bool:
    """Sample the rank's stacks at random moments until one shows it inside the hook's collectives."""
    for _ in range(tries):
        if _print_stacks(pid, job_log) and phase_at_fault(job_log) == "hook collectives":
            return True
        time.sleep(rng.uniform(0, 0.05))
    return False


def _link(cluster: EmulatedCluster, host: int, state: str) -> None:
    subprocess.run(["ip", "-n", cluster.host_netns(host), "link", "set", cluster.host_ifname(host), state], check=True)


def _wait_for_checkpoint_write(job: faults.Job, rank: int) -> None:
    """Return as soon as ``rank`` writes a checkpoint newer than the published ones."""
    folder = checkpoint.checkpoint_dir(job.run_dir)
    while not job.ended():
        names = [p.name for p in folder.glob(f"*rank{rank}.pt*")] if folder.exists() else []
        published = set()
        try:
            published = {checkpoint.rank_file(job.run_dir, rank, s).name for s in checkpoint.read_latest(job.run_dir)["steps"]}
        except checkpoint.CheckpointError:
            pass
        if any(n.endswith(".tmp") or n not in published for n in names):
            return
        time.sleep(0.002)


def phase_at_fault(job_log: Path) -> str:
    """The phase named by the last stacks the victim printed (its main thread's frames, innermost first).

    Ranks inherit their agent's stderr, so the stacks are in the job's log; only the victim
    is asked for them."""
    blocks = re.split(r"^(?=(?:Current thread|Thread) 0x)", job_log.read_text(errors="replace"), flags=re.M)
    mains = [b for b in blocks if STACKS in b and "in run_rank" in b]
    if not mains:
        return "no stack printed"
    for frame in (line.strip() for line in mains[-1].splitlines() if line.startswith("  File ")):
        for name, pattern in PHASES:
            if pattern.search(frame):
                return name
    return "other"


def trial(root: Path, kind: str, index: int, cluster: EmulatedCluster, reference: Any, args: argparse.Namespace,
          rng: random.Random) -> dict[str, Any]:
    name = f"{kind}-{index}"
    config = faults.prepare(root / name, faults.training_args(STEPS, EVERY, timeout_s=args.pg_timeout))
    job_log = root / f"{name}.log"
    job = faults.start(config, cluster, args.max_restarts, job_log, port=faults.RDZV_PORT + 100 + index)
    at_step = rng.randint(2, EVERY - 2) if kind.endswith("checkpoint") else rng.randint(EVERY + 1, STEPS - 6)
    victim = rng.randint(0, 1)
    row: dict[str, Any] = {"fault": kind, "trial": index, "victim": victim, "at_step": at_step}
    if not faults.wait_for_step(job, at_step, args.limit):
        row["outcome"] = faults.judge(job, faults.wait_to_end(job, args.limit), STEPS, reference) + " (before the fault)"
        return row
    rank0 = job.worker_pids().get(0)
    hit = time.monotonic()
    row["detail"] = inject(kind, job, cluster, victim, rng, job_log)
    if row["detail"] == MISSED:
        faults.wait_to_end(job, args.limit)
        row["outcome"] = NOT_INJECTED
        return row
    restarted = faults.wait_for_resume(job, rank0, args.limit) is not None
    row["resume_s"] = time.monotonic() - hit if restarted else None  # fault -> first resumed step
    row["outcome"] = faults.judge(job, faults.wait_to_end(job, args.limit), STEPS, reference)
    row["ended_s"] = time.monotonic() - hit  # fault -> every agent exited
    row["restarted"] = restarted
    row["phase"] = phase_at_fault(job_log) if kind.startswith(("kill", "stop")) else "-"
    row["total_s"] = time.monotonic() - job.started
    if row["outcome"] == "error":
        # The ranks that lived write error-rank<r>.json (a killed or stopped rank cannot).
        errors = {r: json.loads(p.read_text())["error"] for r in range(2) if (p := error_file(config.parent, r)).exists()}
        row["error"] = " | ".join(f"rank {r}: {e[:160]}" for r, e in sorted(errors.items()))
        survivors = [r for r in range(2) if not (kind.startswith(("kill", "stop")) and r == victim)]
        row["every_survivor_reported"] = all(r in errors for r in survivors)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=3, help="trials of each fault")
    parser.add_argument("--faults", default=",".join(FAULTS))
    parser.add_argument("--pg-timeout", type=float, default=20.0, help="the ranks' process-group timeout (seconds)")
    parser.add_argument("--limit", type=float, default=300.0, help="seconds before a trial counts as a hang")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-restarts", type=int, default=1,
                        help="torchrun's restarts (0: every fault that stops the job must end in a clear error)")
    parser.add_argument("--name", default="chaos", help="results file names: NAME.csv, NAME.json, NAME.png")
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("chaos.py needs root (emulated hosts: network namespaces, tc)")
    kinds = args.faults.split(",")
    unknown = sorted(set(kinds) - set(FAULTS))
    if unknown:
        sys.exit(f"unknown fault(s) {', '.join(unknown)}; choose from {', '.join(FAULTS)}")
    rng = random.Random(args.seed)
    order = [(kind, i) for i in range(args.trials) for kind in kinds]
    rows = []
    with tempfile.TemporaryDirectory(prefix="chaos-") as tmp, EmulatedCluster(2, "1gbit") as cluster:
        root = Path(tmp)
        reference = faults.reference_model(root, faults.training_args(STEPS, EVERY, args.pg_timeout), args.limit)
        for kind, i in order:
            rows.append(trial(root, kind, i, cluster, reference, args, rng))
            print(json.dumps(rows[-1]), flush=True)
            _write(rows, args)
    print(json.dumps(_summary(rows, args), indent=2))


def _summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    return {
        "command": "python benchmarks/chaos.py " + " ".join(sys.argv[1:]),
        "pg_timeout_s": args.pg_timeout,
        "max_restarts": args.max_restarts,
        "hang_limit_s": args.limit,
        "faults_injected": sum(r["outcome"] != NOT_INJECTED for r in rows),
        "outcomes": dict(Counter(r["outcome"] for r in rows)),
        "by_fault": {
            kind: dict(Counter(r["outcome"] for r in rows if r["fault"] == kind))
            for kind in dict.fromkeys(r["fault"] for r in rows)
        },
        "phases_hit": dict(Counter(r.get("phase", "-") for r in rows if r.get("phase", "-") != "-")),
        "restarted": sum(bool(r.get("restarted")) for r in rows),
        "errors_reported_by_every_surviving_rank": sum(bool(r.get("every_survivor_reported")) for r in rows),
        "max_fault_to_end_s_of_errors": max((r["ended_s"] for r in rows if r["outcome"] == "error"), default=None),
    }


def _write(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Results so far (rewritten after every trial, so a long run's partial results survive)."""
    faults.RESULTS.mkdir(exist_ok=True)
    fields = ["fault", "trial", "victim", "at_step", "phase", "detail", "outcome", "restarted", "resume_s", "ended_s",
              "total_s", "error", "every_survivor_reported"]
    common.write_csv(faults.RESULTS / f"{args.name}.csv", [{k: r.get(k) for k in fields} for r in rows])
    summary = _summary(rows, args)
    (faults.RESULTS / f"{args.name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(rows, args)


def _plot(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    kinds = list(dict.fromkeys(r["fault"] for r in rows))
    outcomes = sorted({r["outcome"] for r in rows})
    colors = {"ok": "tab:green", "error": "tab:orange", "hang": "tab:red", "wrong": "black"}
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0] * len(kinds)
    for outcome in outcomes:
        counts = [sum(r["fault"] == k and r["outcome"] == outcome for r in rows) for k in kinds]
        ax.bar(kinds, counts, bottom=bottom, label=outcome, color=colors.get(outcome, "tab:gray"))
        bottom = [b + c for b, c in zip(bottom, counts)]
    ax.set_ylabel("trials")
    ax.set_title(f"chaos: one fault per run, 2 emulated hosts, torchrun --max-restarts {args.max_restarts}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(faults.RESULTS / f"{args.name}.png", dpi=120)


if __name__ == "__main__":
    main()
