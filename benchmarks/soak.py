"""Soak run: 4 ranks on the emulated network for a long time, bandwidth changing throughout.

    sudo .venv/bin/python benchmarks/soak.py                 # 20 minutes (the issue's minimum)
    sudo .venv/bin/python benchmarks/soak.py --minutes 60    # the elastic issue's hour
    sudo .venv/bin/python benchmarks/soak.py --minutes 2     # a short check

Starts ``flexcomm-train`` with the adaptive engine on (ResNet-18 x0.125, ``--compressor
flex --density auto``, 4 emulated hosts, a schedule that cycles 1 Gbit -> 50 Mbit ->
200 Mbit -> 20 Mbit), samples every rank's resident memory (VmRSS from /proc) every few
seconds, and stops the job with SIGTERM after the time is up (the launcher then stops the
ranks and removes the emulated network).  Then checks the step records: every step once,
in order, with a finite loss.  Writes ``benchmarks/results/soak.csv`` (memory samples),
``soak.json`` (steps, records check, densities and exchanges chosen, memory growth per
rank, errors, the code's commit) and ``soak.png``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from flexcomm.launch import rank_pids  # noqa: E402
from flexcomm.train.records import read_records  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: Share of the run counted as start-up when judging memory growth.
STEADY_AFTER = 0.25
#: The issue's goal: resident memory flat within this much per rank over the steady window.
FLAT_MB = 1.0
#: One cycle of the link's bandwidth, repeated for the whole run.
CYCLE = "1gbit:60s,50mbit:60s,200mbit:60s,20mbit:60s,"
CYCLE_MINUTES = 4


def schedule(minutes: float) -> str:
    """The bandwidth schedule: the cycle repeated past ``minutes``, so the link changes throughout."""
    return CYCLE * (math.ceil(minutes / CYCLE_MINUTES) + 1) + "1gbit"



def rss_mb(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument("--out", type=Path, default=RESULTS / "runs" / "soak")
    parser.add_argument("--commit", default=_head(), help="the commit of the code under test, for soak.json "
                        "(default: this checkout's HEAD)")
    args = parser.parse_args()
    if args.out.exists():
        subprocess.run(["rm", "-rf", str(args.out)], check=True)
    train = Path(sys.executable).with_name("flexcomm-train")
    argv = [str(train), "--model", "resnet18", "--nproc", "4", "--compressor", "flex", "--density", "auto",
            # The density controller decides every 20 steps after 20 dense ones: many decisions in the soak.
            "--auto-warmup", "20", "--auto-every", "20",
            "--net", schedule(args.minutes), "--steps", "1000000", "--eval-every", "100", "--test-subset", "500",
            "--checkpoint-every", "100", "--timeout", "120", "--no-report", "--out", str(args.out)]
    started = time.monotonic()
    # The job's output goes to a file: a pipe nobody reads fills up after ~64 KB of progress
    # bars and blocks the ranks mid-step (seen in the first soak attempt).
    log_path = RESULTS / "soak.log"
    RESULTS.mkdir(exist_ok=True)
    log = open(log_path, "w")
    job = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, text=True)
    config = args.out / "config.json"
    samples: list[dict[str, float]] = []
    deadline = started + args.minutes * 60
    while time.monotonic() < deadline and job.poll() is None:
        time.sleep(args.sample_every)
        for rank, pid in sorted(rank_pids("flexcomm.train.worker", str(config)).items()):
            mb = rss_mb(pid)
            if mb is not None:
                samples.append({"t_s": time.monotonic() - started, "rank": rank, "rss_mb": mb})
        print(f"\rsoak: {(time.monotonic() - started) / 60:5.1f} / {args.minutes:g} min, "
              f"{_steps(args.out)} steps", end="", flush=True)
    crashed = job.poll() is not None
    if not crashed:
        job.send_signal(signal.SIGTERM)  # SIGINT to the launcher alone did not stop it (first soak)
    job.wait(timeout=120)
    log.close()
    output = log_path.read_text()
    print()
    summary = _summarize(args, samples, crashed, output, time.monotonic() - started)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    with open(RESULTS / "soak.csv", "w") as f:
        f.write("t_s,rank,rss_mb\n")
        f.writelines(f"{s['t_s']:.1f},{s['rank']},{s['rss_mb']:.1f}\n" for s in samples)
    _plot(samples, summary)
    print(json.dumps({k: v for k, v in summary.items() if k != "launcher_output_tail"}, indent=2))


def _steps(run_dir: Path) -> int:
    return len(read_records(run_dir))


def _summarize(args: argparse.Namespace, samples: list[dict[str, float]], crashed: bool, output: str, wall: float) -> dict:
    growth = {}
    for rank in sorted({int(s["rank"]) for s in samples}):
        mine = [s for s in samples if s["rank"] == rank]
        # Steady state: the last three quarters of the run.  Start-up (data, model, DDP's
        # buckets, the first checkpoint, allocator pools) takes minutes on a loaded machine
        # and would pass for a leak.
        steady = [s for s in mine if s["t_s"] >= mine[0]["t_s"] + STEADY_AFTER * (mine[-1]["t_s"] - mine[0]["t_s"])]
        if len(steady) >= 2:
            slope = float(np.polyfit([s["t_s"] for s in steady], [s["rss_mb"] for s in steady], 1)[0])
        else:
            slope = float("nan")
        # Growth over the window from the fitted line (one sample's noise does not decide it).
        fitted = slope * (steady[-1]["t_s"] - steady[0]["t_s"])
        growth[rank] = {"first_mb": mine[0]["rss_mb"], "last_mb": mine[-1]["rss_mb"],
                        "max_mb": max(s["rss_mb"] for s in mine), "steady_from_s": steady[0]["t_s"],
                        "steady_growth_mb": steady[-1]["rss_mb"] - steady[0]["rss_mb"],
                        "steady_range_mb": max(s["rss_mb"] for s in steady) - min(s["rss_mb"] for s in steady),
                        "steady_fitted_growth_mb": fitted,
                        "steady_slope_mb_per_min": slope * 60,
                        f"flat_within_{FLAT_MB:g}_mb": bool(abs(fitted) <= FLAT_MB)}
    network = args.out / "network.json"
    return {
        "command": "python benchmarks/soak.py --minutes %g" % args.minutes,
        "minutes": wall / 60,
        "steps_completed": _steps(args.out),
        "ended_by": "the job itself (error)" if crashed else "SIGTERM after the time limit",
        "rate_changes_applied": len(json.loads(network.read_text()).get("changes", [])) if network.exists() else None,
        "commit": args.commit,
        "records": _check_records(read_records(args.out)),
        "memory_per_rank": growth,
        "errors": sorted(p.name for p in args.out.glob("error-rank*.json")),
        "launcher_output_tail": output[-2000:].split("\r")[-1],
    }


def _check_records(records: list[dict]) -> dict:
    """Every step logged once, in order, with a finite loss; which densities and exchanges the engine chose."""
    steps = [r["step"] for r in records]
    exchanges = Counter(e for r in records for e in r.get("exchanges", []))
    return {
        "complete": steps == list(range(len(steps))),
        "repeated_steps": len(steps) - len(set(steps)),
        "missing_steps": len(set(range(max(steps, default=-1) + 1)) - set(steps)),
        "nonfinite_loss_steps": [r["step"] for r in records if not math.isfinite(r["loss"])],
        "densities_used": sorted({r["density"] for r in records}),
        "exchanges_used": dict(exchanges),
    }


def _head() -> str | None:
    done = subprocess.run(["git", "-C", str(Path(__file__).parent), "rev-parse", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or None


def _plot(samples: list[dict[str, float]], summary: dict) -> None:
    """Left: resident memory per rank over the run; right: its change over the steady window."""
    fig, (whole, steady_ax) = plt.subplots(1, 2, figsize=(12, 4))
    steady_from = min(g["steady_from_s"] for g in summary["memory_per_rank"].values())
    for rank in sorted({int(s["rank"]) for s in samples}):
        mine = [s for s in samples if s["rank"] == rank]
        whole.plot([s["t_s"] / 60 for s in mine], [s["rss_mb"] for s in mine], label=f"rank {rank}")
        steady = [s for s in mine if s["t_s"] >= steady_from]
        if steady:
            growth = summary["memory_per_rank"][rank]["steady_fitted_growth_mb"]
            steady_ax.plot([s["t_s"] / 60 for s in steady], [s["rss_mb"] - steady[0]["rss_mb"] for s in steady],
                           label=f"rank {rank}: {growth:+.2f} MB fitted")
    whole.axvline(steady_from / 60, color="gray", linestyle=":", label="steady window from here")
    whole.set(xlabel="minutes", ylabel="resident memory (MB)",
              title=f"4 ranks, flex + density auto, changing bandwidth; {summary['steps_completed']} steps")
    steady_ax.axhspan(-FLAT_MB, FLAT_MB, color="green", alpha=0.1, label=f"goal: within {FLAT_MB:g} MB")
    steady_ax.set(xlabel="minutes", ylabel="MB since the steady window began", title="steady window")
    for ax in (whole, steady_ax):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=120)


if __name__ == "__main__":
    if os.geteuid() != 0:
        sys.exit("soak.py needs root for the emulated network (network namespaces, tc)")
    main()
