"""A rank SIGKILLed mid-training, many times: does the restart always work?

    sudo .venv/bin/python benchmarks/restart.py                  # 20 trials loopback + 20 across 2 emulated hosts
    .venv/bin/python benchmarks/restart.py --modes loopback --trials 5

Each trial starts a small run under torchrun with ``--max-restarts 1`` (see
``benchmarks/faults.py``: one agent on loopback, or one agent per emulated host with a
c10d rendezvous), SIGKILLs rank 1 at a random step between two checkpoints, and waits for
the job to end (a trial still running after ``--limit`` seconds is a hang and is killed).
A trial succeeds when the job exits 0 with every step logged once and a final model
bitwise equal to an uninterrupted run's.  Also measured: the seconds from the kill to the
restarted ranks' first logged step.  Writes ``benchmarks/results/restart.{csv,json,png}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
import faults  # noqa: E402

from flexcomm.netem import EmulatedCluster  # noqa: E402

STEPS, EVERY = 30, 10


def trial(root: Path, mode: str, index: int, cluster: EmulatedCluster | None, reference: Any, limit: float,
          rng: random.Random) -> dict[str, Any]:
    config = faults.prepare(root / f"{mode}-{index}", faults.training_args(STEPS, EVERY, timeout_s=60))
    kill_after = rng.randint(EVERY + 1, 2 * EVERY - 3)  # after one checkpoint, well before the next
    job = faults.start(config, cluster, 1, root / f"{mode}-{index}.log", port=faults.RDZV_PORT + index)
    row: dict[str, Any] = {"mode": mode, "trial": index, "kill_after_step": kill_after, "resume_s": None}
    if not faults.wait_for_step(job, kill_after, limit):
        row["outcome"] = faults.judge(job, faults.wait_to_end(job, limit), STEPS, reference) + " (before the kill)"
        return row
    pids = job.worker_pids()
    os.kill(pids[1], signal.SIGKILL)
    row["resume_s"] = faults.wait_for_resume(job, pids.get(0), limit)
    row["outcome"] = faults.judge(job, faults.wait_to_end(job, limit), STEPS, reference)
    row["total_s"] = time.monotonic() - job.started
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--modes", default="loopback,emulated")
    parser.add_argument("--limit", type=float, default=240.0, help="seconds before a trial counts as a hang")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    modes = args.modes.split(",")
    if "emulated" in modes and os.geteuid() != 0:
        sys.exit("--modes emulated needs root (network namespaces, tc)")
    rng = random.Random(args.seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="restart-") as tmp:
        root = Path(tmp)
        reference = faults.reference_model(root, faults.training_args(STEPS, EVERY, timeout_s=60), args.limit)
        for mode in modes:
            with EmulatedCluster(2, "1gbit") if mode == "emulated" else contextlib.nullcontext() as cluster:
                for i in range(args.trials):
                    rows.append(trial(root, mode, i, cluster, reference, args.limit, rng))
                    print(json.dumps(rows[-1]), flush=True)
                    if rows[-1]["outcome"] != "ok":
                        print((root / f"{mode}-{i}.log").read_text()[-3000:], flush=True)
    summary = summarize(rows, args)
    faults.RESULTS.mkdir(exist_ok=True)
    columns = ("mode", "trial", "kill_after_step", "outcome", "resume_s", "total_s")
    common.write_csv(faults.RESULTS / "restart.csv", [{k: r.get(k) for k in columns} for r in rows])
    (faults.RESULTS / "restart.json").write_text(json.dumps(summary, indent=2) + "\n")
    plot(rows, summary)
    print(json.dumps(summary, indent=2))


def summarize(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    summary: dict[str, Any] = {"command": "python benchmarks/restart.py " + " ".join(sys.argv[1:]),
                               "steps": STEPS, "checkpoint_every": EVERY, "hang_limit_s": args.limit, "modes": {}}
    for mode in dict.fromkeys(r["mode"] for r in rows):
        mine = [r for r in rows if r["mode"] == mode]
        resumed = [r["resume_s"] for r in mine if r["resume_s"] is not None]
        summary["modes"][mode] = {
            "trials": len(mine),
            "successes": sum(r["outcome"] == "ok" for r in mine),
            "outcomes": {o: sum(r["outcome"] == o for r in mine) for o in sorted({r["outcome"] for r in mine})},
            "kill_to_first_resumed_step_s": {
                "median": statistics.median(resumed), "min": min(resumed), "max": max(resumed),
            } if resumed else None,
        }
    return summary


def plot(rows: list[dict[str, Any]], summary: dict[str, Any]) -> None:
    modes = list(summary["modes"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    ok = [summary["modes"][m]["successes"] for m in modes]
    trials = [summary["modes"][m]["trials"] for m in modes]
    left.bar(modes, trials, color="lightgray", label="trials")
    left.bar(modes, ok, color="tab:green", label="resumed, bitwise-equal model")
    left.set_ylabel("trials")
    left.set_title("rank 1 SIGKILLed mid-training")
    left.legend(loc="lower right")
    right.boxplot([[r["resume_s"] for r in rows if r["mode"] == m and r["resume_s"] is not None] for m in modes])
    right.set_xticks(range(1, len(modes) + 1), modes)
    right.set_ylabel("seconds")
    right.set_title("kill -> first resumed step")
    fig.tight_layout()
    fig.savefig(faults.RESULTS / "restart.png", dpi=120)


if __name__ == "__main__":
    main()
