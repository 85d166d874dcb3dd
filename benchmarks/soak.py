"""Soak run: 4 ranks on the emulated network for a long time, bandwidth changing throughout.

    sudo .venv/bin/python benchmarks/soak.py                 # 20 minutes (the issue's minimum)
    sudo .venv/bin/python benchmarks/soak.py --minutes 60    # the elastic issue's hour
    sudo .venv/bin/python benchmarks/soak.py --minutes 2     # a short check
    .venv/bin/python benchmarks/soak.py --report-only        # summary and plot again from soak.csv

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
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from common import proc_status_kib  # noqa: E402
from flexcomm.launch import rank_pids  # noqa: E402
from flexcomm.train.records import read_records  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
#: Share of the run counted as start-up when judging memory growth.
STEADY_AFTER = 0.25
#: The issue's goal: resident memory flat within this much per rank over the steady window.
FLAT_MB = 1.0
#: Memory read from outside catches a rank mid-evaluation or mid-checkpoint, holding that
#: work's transient buffers (~10 MB here); the floor is the lowest sample per block this long.
FLOOR_BLOCK_S = 120.0
#: One cycle of the link's bandwidth, repeated for the whole run.
CYCLE = "1gbit:60s,50mbit:60s,200mbit:60s,20mbit:60s,"
CYCLE_MINUTES = 4


def schedule(minutes: float) -> str:
    """The bandwidth schedule: the cycle repeated past ``minutes``, so the link changes throughout."""
    return CYCLE * (math.ceil(minutes / CYCLE_MINUTES) + 1) + "1gbit"



def rss_mb(pid: int) -> float | None:
    """The rank's resident memory, or None once it is gone (or a zombie, which has no VmRSS)."""
    try:
        return proc_status_kib("VmRSS", pid) / 1024
    except (OSError, RuntimeError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--sample-every", type=float, default=5.0, help="seconds between memory samples")
    parser.add_argument("--out", type=Path, default=RESULTS / "runs" / "soak")
    parser.add_argument("--commit", default=_head(), help="the commit of the code under test, for soak.json "
                        "(default: this checkout's HEAD)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: recompute the memory summary and plot from soak.csv and soak.json")
    args = parser.parse_args()
    if args.report_only:
        report_again()
        return
    if os.geteuid() != 0:
        sys.exit("soak.py needs root for the emulated network (network namespaces, tc)")
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
    growth = memory_per_rank(samples)
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


def memory_per_rank(samples: list[dict[str, float]]) -> dict[int, dict[str, Any]]:
    """Per rank: resident memory over the steady window, raw and as its floor (see the module doc)."""
    growth = {}
    for rank in sorted({int(s["rank"]) for s in samples}):
        mine = [s for s in samples if s["rank"] == rank]
        # Steady state: the last three quarters of the run.  Start-up (data, model, DDP's
        # buckets, the first checkpoint, allocator pools) takes minutes on a loaded machine
        # and would pass for a leak.
        steady = [s for s in mine if s["t_s"] >= mine[0]["t_s"] + STEADY_AFTER * (mine[-1]["t_s"] - mine[0]["t_s"])]
        floor = _floor(steady)
        growth[rank] = {"first_mb": mine[0]["rss_mb"], "last_mb": mine[-1]["rss_mb"],
                        "max_mb": max(s["rss_mb"] for s in mine), "steady_from_s": steady[0]["t_s"],
                        "steady_growth_mb": steady[-1]["rss_mb"] - steady[0]["rss_mb"],
                        "steady_range_mb": max(s["rss_mb"] for s in steady) - min(s["rss_mb"] for s in steady),
                        "steady_fitted_growth_mb": _fitted_growth(steady),
                        "floor_block_s": FLOOR_BLOCK_S,
                        "steady_floor_range_mb": max(s["rss_mb"] for s in floor) - min(s["rss_mb"] for s in floor),
                        "steady_floor_fitted_growth_mb": _fitted_growth(floor),
                        f"flat_within_{FLAT_MB:g}_mb": bool(abs(_fitted_growth(floor)) <= FLAT_MB)}
    return growth


def _floor(samples: list[dict[str, float]]) -> list[dict[str, float]]:
    """The lowest sample of each ``FLOOR_BLOCK_S`` block: memory between evaluations and checkpoints."""
    blocks: dict[int, dict[str, float]] = {}
    for s in samples:
        block = int((s["t_s"] - samples[0]["t_s"]) // FLOOR_BLOCK_S)
        if block not in blocks or s["rss_mb"] < blocks[block]["rss_mb"]:
            blocks[block] = s
    return [blocks[b] for b in sorted(blocks)]


def _fitted_growth(samples: list[dict[str, float]]) -> float:
    """Growth over the samples' span from a least-squares line (one sample's noise does not decide it)."""
    if len(samples) < 2:
        return float("nan")
    times = [s["t_s"] for s in samples]
    slope = float(np.polyfit(times, [s["rss_mb"] for s in samples], 1)[0])
    return slope * (times[-1] - times[0])


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
            floor = _floor(steady)
            growth = summary["memory_per_rank"][rank]["steady_floor_fitted_growth_mb"]
            line, = steady_ax.plot([s["t_s"] / 60 for s in steady], [s["rss_mb"] - floor[0]["rss_mb"] for s in steady],
                                   alpha=0.3, linewidth=0.8)
            steady_ax.plot([s["t_s"] / 60 for s in floor], [s["rss_mb"] - floor[0]["rss_mb"] for s in floor],
                           color=line.get_color(), marker=".", label=f"rank {rank} floor: {growth:+.2f} MB fitted")
    whole.axvline(steady_from / 60, color="gray", linestyle=":", label="steady window from here")
    whole.set(xlabel="minutes", ylabel="resident memory (MB)",
              title=f"4 ranks, flex + density auto, changing bandwidth; {summary['steps_completed']} steps")
    steady_ax.axhspan(-FLAT_MB, FLAT_MB, color="green", alpha=0.1, label=f"goal: within {FLAT_MB:g} MB")
    steady_ax.set(xlabel="minutes", ylabel="MB since the window's first floor",
                  title=f"steady window: samples (faint), lowest per {FLOOR_BLOCK_S / 60:g} min (dots)")
    for ax in (whole, steady_ax):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(RESULTS / "soak.png", dpi=120)


def report_again() -> None:
    """The memory summary and plot of the last soak, from its samples (the rest of soak.json is kept)."""
    with open(RESULTS / "soak.csv") as f:
        samples = [{"t_s": float(t), "rank": int(r), "rss_mb": float(mb)}
                   for t, r, mb in (line.strip().split(",") for line in f.readlines()[1:])]
    summary = json.loads((RESULTS / "soak.json").read_text())
    summary["memory_per_rank"] = memory_per_rank(samples)
    (RESULTS / "soak.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(samples, summary)
    print(json.dumps(summary["memory_per_rank"], indent=2))


if __name__ == "__main__":
    main()
