"""``flexcomm-demo``: plain DDP, PyTorch's PowerSGD and flexcomm side by side, on a link whose bandwidth changes.

Three ``flexcomm-train`` runs with the same model, data, seed and step count: plain DDP
(``--compressor dense``: every gradient element, every step), PyTorch's own PowerSGD hook
(rank 4, its standard error feedback and warm start) and flexcomm as a user turns it on
(``--compressor flex --density auto``: per bucket the exchange, and the density, that the
measured network and the gradients call for).  The model is an MLP with two wide hidden
layers: little compute per parameter, so the network decides how fast it trains.  Every run
has one DDP bucket holding every gradient (``--bucket-cap-mb one``, :data:`DEMO_BUCKETS`), the
layout PyTorch's PowerSGD needs on gloo, so the three differ in their exchange alone (DDP's default
gives this MLP two buckets, and on a host with a core per rank a second bucket costs more than its
overlap saves: see ``benchmarks/adaptive_e2e.py``, "Buckets").  Each
rank is its own emulated host; the link's bandwidth follows :data:`DEMO_SCHEDULE` from the
moment training starts (root is needed; elsewhere the runs fall back to plain loopback and
say so: there the network is fast and dense DDP has little to lose).

Every run evaluates on the full test set (10,000 images) every :data:`EVAL_EVERY` steps, which
places the time to target within a few steps (every 25, at 200 ms a step on the slow link, put
5 s steps on it); the link's schedule stands still while the ranks evaluate.  At the end it prints
a table -- time to the target accuracy (0.95 of dense's best unless ``--target-acc``), final
accuracy (mean of the last 3 evaluations :data:`FINAL_EVERY` steps apart), bytes each rank sent --
and a verdict that says where flexcomm did not win, and writes ``flexcomm-report``'s plots
of the runs (accuracy against time, where each step's time went).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any

from flexcomm.netem import netem_available
from flexcomm.train import cli
from flexcomm.train.records import FINAL_EVALS, final_accuracy, read_records, read_summary, summarize

#: Fast, then a fifth of the bandwidth for a while, then fast again.
DEMO_SCHEDULE = "100mbit:5s,20mbit:15s,100mbit"
DEMO_MODEL = ["--model", "mlp", "--width", "0.5"]  # 669,706 parameters: 2.7 MB of gradients per step
DEFAULT_STEPS = 300
#: Every run's DDP buckets: one (what PowerSGD needs on gloo); options after ``--`` may say otherwise.
DEMO_BUCKETS = ["--bucket-cap-mb", "one"]
#: The time to target is compared at this fraction of dense's best accuracy (unless --target-acc).
TARGET_FRACTION = 0.95
FULL_TEST_SET = "10000"
EVAL_EVERY = 5
FINAL_EVERY = 25
POWERSGD_RANK = "4"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexcomm-demo", usage="%(prog)s [options] [-- FLEXCOMM-TRAIN OPTIONS]",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog="Options after -- go to every flexcomm-train run (e.g. -- --dataset synthetic).",
    )
    parser.add_argument("--compressor", default="flex", help="flexcomm's side (default: %(default)s)")
    parser.add_argument("--density", default="auto", help="flexcomm's density, or 'auto' (default: %(default)s)")
    parser.add_argument("--net", default=DEMO_SCHEDULE, metavar="SCHEDULE",
                        help="the emulated link's bandwidth schedule, as flexcomm-train --net; 'none' = loopback "
                             "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps of each run (default: %(default)s)")
    parser.add_argument("--target-acc", type=float, metavar="ACC",
                        help=f"the accuracy whose time is compared (default: {TARGET_FRACTION} x dense's best); "
                             "every run trains all steps")
    parser.add_argument("--out", type=Path, help="where the runs and the plots go (default: runs/demo-<timestamp>)")
    return parser


def main(argv: list[str] | None = None) -> None:
    own, passed_on = _split_at_dashes(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(own)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.target_acc is not None and not 0.0 < args.target_acc <= 1.0:
        parser.error(f"--target-acc must be in (0, 1], got {args.target_acc}")
    started = time.perf_counter()
    out = args.out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    net = _network(args.net)
    flexcomm_name = "flexcomm" if (args.compressor, args.density) == ("flex", "auto") else \
        f"flexcomm ({args.compressor}, {args.density})"
    runs = {
        "dense DDP": (out / "dense", ["--compressor", "dense"]),
        f"PowerSGD r{POWERSGD_RANK}": (out / "powersgd", ["--compressor", "powersgd", "--powersgd-rank", POWERSGD_RANK]),
        flexcomm_name: (out / "flexcomm", ["--compressor", args.compressor, "--density", args.density]),
    }
    common = [*DEMO_MODEL, "--steps", str(args.steps), "--eval-every", str(EVAL_EVERY), "--test-subset", FULL_TEST_SET,
              "--net", net, "--no-report", *DEMO_BUCKETS, *passed_on]
    for name, (run_dir, exchange) in runs.items():
        print(f"\nflexcomm-demo: {name}", flush=True)
        cli.main([*common, *exchange, "--out", str(run_dir)])

    from flexcomm.train.report import write_report  # matplotlib: only once there is something to plot

    run_dirs = {name: run_dir for name, (run_dir, _) in runs.items()}
    written = write_report(list(run_dirs.values()), out)
    target = args.target_acc or _default_target(run_dirs["dense DDP"])
    results = {name: _result(run_dir, target) for name, run_dir in run_dirs.items()}
    print()
    print(format_table(results, target))
    print()
    print(verdict(results, flexcomm_name))
    network = "plain loopback" if net == "none" else f"emulated link {net}"
    print(f"\n{len(runs)} runs of {args.steps} steps over {network}; total wall time "
          f"{time.perf_counter() - started:.0f} s (start-up and evaluation included)")
    for path in written:
        if path.name in ("accuracy.png", "step_time.png"):
            print(f"plot: {path}")


def _default_target(dense_dir: Path) -> float:
    """:data:`TARGET_FRACTION` of dense's best evaluation, rounded down to 0.1 point."""
    best = summarize(read_records(dense_dir), None)["best_accuracy"] or 0.0
    return math.floor(TARGET_FRACTION * best * 1000) / 1000


def _split_at_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """The demo's own options, and those after ``--`` for flexcomm-train."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def _network(requested: str) -> str:
    """The schedule to run, or ``"none"`` (with the reason) where emulation is unavailable."""
    if requested == "none":
        return "none"
    available, reason = netem_available()
    if not available:
        print(f"flexcomm-demo: network emulation unavailable ({reason}); running on plain loopback, where the "
              "network is fast and dense DDP has little to lose. Run as root to see the point.", flush=True)
        return "none"
    return requested


def _result(run_dir: Path, target: float) -> dict[str, Any]:
    """Both runs train every step; the time to ``target`` is read from the records afterwards."""
    summary = read_summary(run_dir) or {}
    records = read_records(run_dir)
    return {**summary, **summarize(records, target), "final_accuracy_mean": final_accuracy(records, FINAL_EVERY)}


def format_table(results: dict[str, dict[str, Any]], target: float) -> str:
    """A plain-text table, one column per run, plus how much faster than the first run each is."""
    names = list(results)
    baseline = results[names[0]].get("time_to_target")
    rows: list[tuple[str, list[str]]] = [
        (f"time to {target:.1%} accuracy", [_time_to_target(r.get("time_to_target"), baseline) for r in results.values()]),
        (f"final accuracy (last {FINAL_EVALS} evals, every {FINAL_EVERY} steps)", [f"{r['final_accuracy_mean']:.3f}" for r in results.values()]),
        ("bytes sent per rank", [f"{r['total_bytes'] / 1e6:,.1f} MB" for r in results.values()]),
        ("mean step time", [f"{r['mean_step_time'] * 1e3:.0f} ms" for r in results.values()]),
        ("training time", [f"{r['train_time']:.1f} s" for r in results.values()]),
    ]
    label_width = max(len(label) for label, _ in rows)
    widths = [max(len(name), *(len(cells[i]) for _, cells in rows)) for i, name in enumerate(names)]
    lines = ["  ".join([" " * label_width, *(n.rjust(w) for n, w in zip(names, widths))])]
    for label, cells in rows:
        lines.append("  ".join([label.ljust(label_width), *(c.rjust(w) for c, w in zip(cells, widths))]))
    return "\n".join(lines)


def verdict(results: dict[str, dict[str, Any]], flexcomm_name: str) -> str:
    """One line per comparison, saying plainly where flexcomm did not win."""
    ours = results[flexcomm_name]
    lines = []
    for name, other in results.items():
        if name == flexcomm_name:
            continue
        mine, theirs = ours.get("time_to_target"), other.get("time_to_target")
        if mine is None:
            lines.append(f"flexcomm did not reach the target; {name} " + ("did not either." if theirs is None else f"took {theirs:.1f} s."))
        elif theirs is None:
            lines.append(f"flexcomm reached the target in {mine:.1f} s; {name} did not reach it.")
        elif mine <= theirs:
            lines.append(f"flexcomm reached the target {theirs / mine:.1f}x faster than {name} ({mine:.1f} s vs {theirs:.1f} s).")
        else:
            lines.append(f"flexcomm was SLOWER to the target than {name}: {mine:.1f} s vs {theirs:.1f} s ({mine / theirs:.2f}x).")
    gap = (ours["final_accuracy_mean"] - results["dense DDP"]["final_accuracy_mean"]) * 100
    closeness = "within 1 point of" if gap >= -1.0 else "MORE than 1 point below"
    lines.append(f"flexcomm's final accuracy is {gap:+.1f} points vs dense DDP's ({closeness} it).")
    return "\n".join(lines)


def _time_to_target(seconds: float | None, baseline: float | None) -> str:
    if seconds is None:
        return "not reached"
    if baseline is None or seconds == baseline:
        return f"{seconds:.1f} s"
    return f"{seconds:.1f} s ({baseline / seconds:.1f}x)"


if __name__ == "__main__":
    main(sys.argv[1:])
