"""``flexcomm-demo``: dense DDP and flexcomm side by side, on a link whose bandwidth changes.

Two ``flexcomm-train`` runs with the same model, data, seed and step count: plain DDP
(``--compressor dense``: every gradient element, every step) and flexcomm (default:
AR-Topk with round-robin index source, ``artopk-star``, at density 0.01; ``--compressor
flex`` picks dense Allreduce, AG-Topk or AR-Topk per bucket from the measured network).  The model is an MLP with two wide hidden layers: little compute
per parameter, so the network decides how fast it trains.  Each rank is its own emulated
host; the link's bandwidth follows :data:`DEMO_SCHEDULE` from the moment training starts
(root is needed; elsewhere the runs fall back to plain loopback and say so: there the
network is fast and dense DDP has little to lose).

At the end it prints a table -- time to the target accuracy, final accuracy, bytes each
rank sent -- and writes ``flexcomm-report``'s plots of both runs (accuracy against wall
time, where each step's time went).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from flexcomm.netem import netem_available
from flexcomm.train import cli
from flexcomm.train.records import read_records, read_summary, summarize

#: Fast, then a fifth of the bandwidth for a while, then fast again.
DEMO_SCHEDULE = "100mbit:5s,20mbit:15s,100mbit"
DEMO_MODEL = ["--model", "mlp", "--width", "0.5"]  # 669,706 parameters: 2.7 MB of gradients per step
DEFAULT_STEPS = 200
DEFAULT_TARGET = 0.70


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexcomm-demo", usage="%(prog)s [options] [-- FLEXCOMM-TRAIN OPTIONS]",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog="Options after -- go to both flexcomm-train runs (e.g. -- --dataset synthetic).",
    )
    parser.add_argument("--compressor", default="artopk-star", help="flexcomm's side (default: %(default)s)")
    parser.add_argument("--density", default="0.01", help="flexcomm's density, or 'auto' (default: %(default)s)")
    parser.add_argument("--net", default=DEMO_SCHEDULE, metavar="SCHEDULE",
                        help="the emulated link's bandwidth schedule, as flexcomm-train --net; 'none' = loopback "
                             "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="steps of each run (default: %(default)s)")
    parser.add_argument("--target-acc", type=float, default=DEFAULT_TARGET, metavar="ACC",
                        help="the accuracy whose time is compared; both runs train all steps (default: %(default)s)")
    parser.add_argument("--out", type=Path, help="where the two runs and the plots go (default: runs/demo-<timestamp>)")
    return parser


def main(argv: list[str] | None = None) -> None:
    own, passed_on = _split_at_dashes(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(own)
    started = time.perf_counter()
    out = args.out or Path("runs") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    net = _network(args.net)
    runs = {"dense DDP": out / "dense", f"flexcomm ({args.compressor}, density {args.density})": out / "flexcomm"}
    common = [*DEMO_MODEL, "--steps", str(args.steps), "--eval-every", "25", "--net", net, "--no-report", *passed_on]
    for (name, run_dir), exchange in zip(runs.items(), (["--compressor", "dense"],
                                                        ["--compressor", args.compressor, "--density", args.density])):
        print(f"\nflexcomm-demo: {name}", flush=True)
        cli.main([*common, *exchange, "--out", str(run_dir)])

    from flexcomm.train.report import write_report  # matplotlib: only once there is something to plot

    written = write_report(list(runs.values()), out)
    print()
    print(format_table({name: _result(run_dir, args.target_acc) for name, run_dir in runs.items()}, args.target_acc))
    network = "plain loopback" if net == "none" else f"emulated link {net}"
    print(f"\n{len(runs)} runs of {args.steps} steps over {network}; total wall time "
          f"{time.perf_counter() - started:.0f} s (start-up and evaluation included)")
    for path in written:
        if path.name in ("accuracy.png", "step_time.png"):
            print(f"plot: {path}")


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
    return {**summary, **summarize(read_records(run_dir), target)}


def format_table(results: dict[str, dict[str, Any]], target: float) -> str:
    """A plain-text table, one column per run, plus how much faster than the first run each is."""
    names = list(results)
    baseline = results[names[0]].get("time_to_target")
    rows: list[tuple[str, list[str]]] = [
        (f"time to {target:.0%} accuracy", [_time_to_target(r.get("time_to_target"), baseline) for r in results.values()]),
        ("final accuracy", [f"{r['final_accuracy']:.3f}" for r in results.values()]),
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


def _time_to_target(seconds: float | None, baseline: float | None) -> str:
    if seconds is None:
        return "not reached"
    if baseline is None or seconds == baseline:
        return f"{seconds:.1f} s"
    return f"{seconds:.1f} s ({baseline / seconds:.1f}x)"


if __name__ == "__main__":
    main(sys.argv[1:])
