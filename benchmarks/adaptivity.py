"""How fast does ``flex`` follow a bandwidth change?  One run on 2 emulated hosts.

    python benchmarks/adaptivity.py [--quick] [--schedule 1gbit:20s,20mbit:20s,1gbit] [--last-phase 20]
                                    [--buckets 2000000] [--density 0.1] [--probe-every 10]
                                    [--out-dir benchmarks/results]

Two ranks, one per host of an :class:`flexcomm.netem.EmulatedCluster` whose link rate
follows ``--schedule`` (a :class:`flexcomm.netem.ScheduleRunner`, started when both ranks
are ready to step).  The ranks train a DDP model of :class:`GradientInjector`-style
parameters, one DDP bucket per entry of ``--buckets`` (floats), with the hook in ``flex``
mode (``flex_interval=2``; ``probe_every`` as given) until the last phase has lasted
``--last-phase`` seconds (``--forgetting`` optionally swaps in an estimator with
another forgetting factor, an experiment knob).  Per step (ranks lined up, time = max over ranks) it records
the wall-clock time, the step time, the exchange chosen for every bucket and the
estimated ``(alpha, beta)`` of allreduce, allgather and broadcast from
``state.chooser.params`` (what the decisions use; refreshed at agreement points and probes).

The true rate comes from the runner's ``changes`` (wall time = ``start_wall + time_s``).
Lag of each change: the steps and seconds from the change until the estimated
bandwidth ``8 / beta`` is first within 25% of the new nominal rate (and, since tbf's
burst and gloo's own speed move the effective rate away from the nominal one, until it
is within 25% of the estimate's own settled value in that phase: the median of the
phase's last third).

Writes ``adaptivity.csv`` (per step), ``adaptivity.json`` (changes, lags, settings) and
``adaptivity.png`` (estimated bandwidth vs the true schedule, chosen exchange per bucket).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from collectives import (
    RESULTS,
    aligned_seconds,
    hooked_ddp,
    init_worker,
    max_over_ranks,
    median,
    progress,
    rank_gradient,
    require_emulation,
    train_step,
    worker_config,
    write_csv,
    write_result,
)
from flexcomm.cost import CostEstimator
from flexcomm.netem import EmulatedCluster, RateChange, ScheduleRunner, parse_schedule
from flexcomm.netem.launch import run_ranks

READY = "@@ready"
KINDS = ("allreduce", "allgather", "broadcast")
WITHIN = 0.25


# ============================================================================ worker
def _estimates(state: Any) -> dict[str, float]:
    params = state.chooser.params
    out = {}
    for kind in KINDS:
        link = params.link(kind)
        out[f"alpha_{kind}_s"] = link.alpha
        out[f"bw_{kind}_mbit"] = 8 / link.beta / 1e6 if link.beta > 0 else math.inf
    return out


def worker_main(cfg: dict[str, Any]) -> None:
    """Step ``flex`` until ``duration_s`` after the ready signal; rank 0 writes the per-step log."""
    rank, world = init_worker()
    # DDP fills buckets in reverse parameter order with a 1 MiB first-bucket cap: with the
    # parameters listed small-to-large, the largest (>= 1 MiB) closes bucket 0 on its own
    # and the smaller ones follow in their own buckets (cap = the largest size).
    sizes = sorted(cfg["buckets"])
    model, state = hooked_ddp(sizes, "flex", cfg["density"], flex_interval=cfg["flex_interval"],
                              probe_every=cfg["probe_every"], probe_sizes=tuple(cfg["probe_sizes"]))
    if cfg["forgetting"] is not None:
        # An experiment knob: FlexState does not expose its estimator's forgetting factor.
        state.chooser.estimator = CostEstimator(forgetting=cfg["forgetting"])
        state.chooser.refresh()
    grad = rank_gradient(sum(sizes))
    for _ in range(2):  # the first probe, DDP's first-iteration work
        train_step(model, grad)
    state.drain_records()
    dist.barrier()
    if rank == 0:
        print(f"{READY} {time.time()}", flush=True)
    started = time.time()
    rows = []
    while True:
        step = state.step
        t0 = time.time()
        seconds = aligned_seconds(lambda: train_step(model, grad))
        records = state.drain_records()
        agreed_seconds, elapsed = max_over_ranks([seconds, time.time() - started])
        row = {"step": step, "wall_start": t0, "wall_end": t0 + agreed_seconds, "step_s": agreed_seconds,
               "probed": state._probed_at == step, **_estimates(state)}
        for rec in records:
            row[f"bucket{rec.bucket}_numel"] = rec.numel
            row[f"bucket{rec.bucket}_exchange"] = rec.exchange
            row[f"bucket{rec.bucket}_t_exchange_s"] = rec.t_exchange
            row[f"bucket{rec.bucket}_predicted_s"] = rec.predicted
        rows.append(row)
        progress()
        if elapsed >= cfg["duration_s"]:
            break
    write_result(cfg, rows)
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ launcher
def run(args: argparse.Namespace, schedule: str, duration_s: float) -> tuple[list[dict[str, Any]], list[RateChange], float]:
    """Run the job; start the schedule when rank 0 reports ready.  Returns rows, changes, start wall."""
    import tempfile

    from tqdm import tqdm

    cfg = {"buckets": args.buckets, "density": args.density, "flex_interval": args.flex_interval,
           "probe_every": args.probe_every, "probe_sizes": args.probe_sizes, "duration_s": duration_s,
           "forgetting": args.forgetting}
    runners: list[ScheduleRunner] = []
    ready = threading.Event()
    with tempfile.TemporaryDirectory(prefix="flexcomm-adapt-") as tmp, \
            EmulatedCluster(2, schedule, prefix="fca") as cluster, \
            tqdm(total=None, desc="steps", unit="step", dynamic_ncols=True) as bar:
        cfg["result_path"] = str(Path(tmp) / "result.json")
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(cfg))

        def on_line(rank: int, line: str) -> None:
            if line.startswith(READY) and not ready.is_set():
                runners.append(cluster.start_schedule())
                ready.set()
            elif line.startswith("@@progress"):
                bar.update(1)

        run_ranks(cluster, 2, [str(Path(__file__).resolve()), "--worker", str(cfg_path)],
                  timeout=duration_s * 4 + 600, on_line=on_line)
        runner = runners[0]
        runner.stop()
        rows = json.loads(Path(cfg["result_path"]).read_text())
        return rows, list(runner.changes), float(runner.start_wall or math.nan)


def true_rate_at(wall: float, changes: Sequence[RateChange], start_wall: float) -> float:
    """The rate in force at wall-clock time ``wall`` (the last change applied before it).

    Before the runner's first change the cluster already runs at the first phase's rate
    (it is applied when the cluster starts).
    """
    rate = changes[0].rate_bps if changes else math.nan
    for c in changes:
        if start_wall + c.time_s <= wall:
            rate = c.rate_bps
    return rate


def lag(rows: Sequence[dict[str, Any]], change_wall: float, end_wall: float, kind: str, target_mbit: float
        ) -> dict[str, Any]:
    """Steps and seconds from a change until ``kind``'s estimate is within 25% of ``target_mbit``."""
    after = [r for r in rows if r["wall_start"] >= change_wall and r["wall_start"] < end_wall]
    for i, r in enumerate(after):
        if abs(r[f"bw_{kind}_mbit"] - target_mbit) <= WITHIN * target_mbit:
            return {"steps": i + 1, "seconds": r["wall_end"] - change_wall, "reached": True}
    return {"steps": len(after), "seconds": (after[-1]["wall_end"] - change_wall) if after else math.nan,
            "reached": False}


def lags(rows: Sequence[dict[str, Any]], changes: Sequence[RateChange], start_wall: float) -> list[dict[str, Any]]:
    """For every change after the first: lag to the nominal rate and to the phase's settled estimate."""
    out = []
    walls = [start_wall + c.time_s for c in changes] + [math.inf]
    for j in range(1, len(changes)):
        begin, end = walls[j], walls[j + 1]
        phase = [r for r in rows if begin <= r["wall_start"] < end]
        entry: dict[str, Any] = {"change_s": changes[j].time_s, "from_mbit": changes[j - 1].rate_bps / 1e6,
                                 "to_mbit": changes[j].rate_bps / 1e6, "phase_steps": len(phase)}
        for kind in ("allreduce", "allgather"):
            settled = median([r[f"bw_{kind}_mbit"] for r in phase[len(phase) * 2 // 3:]])
            entry[kind] = {"to_nominal": lag(rows, begin, end, kind, changes[j].rate_bps / 1e6),
                           "settled_mbit": settled, "to_settled": lag(rows, begin, end, kind, settled)}
        out.append(entry)
    return out


def plot(rows: Sequence[dict[str, Any]], changes: Sequence[RateChange], start_wall: float, path: Path,
         buckets: int) -> None:
    """Estimated bandwidth vs the true schedule (top), chosen exchange per bucket and step time (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [r["wall_end"] - start_wall for r in rows]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 7), sharex=True, gridspec_kw={"height_ratios": [2, 1]})
    for kind, color in zip(KINDS, ("tab:blue", "tab:orange", "tab:green")):
        top.plot(t, [r[f"bw_{kind}_mbit"] for r in rows], ".-", ms=3, lw=0.8, color=color, label=f"estimated ({kind})")
    edges = [c.time_s for c in changes] + [t[-1] if t else 0.0]
    for c, (a, b) in zip(changes, zip(edges, edges[1:])):
        top.plot([a, b], [c.rate_bps / 1e6] * 2, "k-", lw=2)
    top.plot([], [], "k-", lw=2, label="true rate (schedule)")
    for a, b in zip(edges[1:-1], edges[1:-1]):
        top.axvline(a, color="gray", ls=":", lw=1)
    top.set(yscale="log", ylabel="Mbit/s", title="flex's estimated bandwidth (8/beta) vs the emulated link rate")
    top.legend(fontsize=8)
    top.grid(True, which="both", alpha=0.3)
    levels = {"dense": 0, "agtopk": 1, "artopk": 2}
    for b in range(buckets):
        key = f"bucket{b}_exchange"
        sel = [(ti, levels[r[key]] + 0.12 * (b - (buckets - 1) / 2)) for ti, r in zip(t, rows) if key in r]
        numel = next((r[f"bucket{b}_numel"] for r in rows if f"bucket{b}_numel" in r), 0)
        bottom.plot([s[0] for s in sel], [s[1] for s in sel], "|", ms=8, label=f"bucket {b} ({numel:,} floats)")
    bottom.set_yticks(list(levels.values()), list(levels))
    bottom.set(xlabel="seconds since the schedule started", ylabel="chosen exchange")
    twin = bottom.twinx()
    twin.plot(t, [r["step_s"] for r in rows], color="tab:gray", lw=0.6, alpha=0.6)
    twin.set(yscale="log", ylabel="step s (gray)")
    bottom.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1gbit:6s,20mbit:6s,1gbit for 6 s more")
    parser.add_argument("--schedule", default="1gbit:20s,20mbit:20s,1gbit")
    parser.add_argument("--last-phase", type=float, default=20.0, help="seconds of the last (open-ended) phase")
    parser.add_argument("--buckets", default="2000000", help="floats per DDP bucket (comma-separated: one bucket each)")
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--flex-interval", type=int, default=2)
    parser.add_argument("--probe-every", type=int, default=10)
    parser.add_argument("--probe-sizes", default="1024,65536,524288", help="bytes")
    parser.add_argument("--forgetting", type=float, default=None,
                        help="replace flex's estimator by one with this forgetting factor (default: the library's)")
    parser.add_argument("--tag", default="", help="suffix of the output files")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    require_emulation()
    if args.quick:
        args.schedule, args.last_phase = "1gbit:6s,20mbit:6s,1gbit", 6.0
    args.buckets = [int(float(b)) for b in args.buckets.split(",")]
    args.probe_sizes = [int(float(b)) for b in args.probe_sizes.split(",")]
    phases = parse_schedule(args.schedule)
    duration = sum(p.duration_s or 0.0 for p in phases) + args.last_phase
    rows, changes, start_wall = run(args, args.schedule, duration)
    for r in rows:
        r["true_mbit"] = true_rate_at(r["wall_start"], changes, start_wall) / 1e6
        r["t_s"] = r["wall_start"] - start_wall
        r["phase"] = max([0] + [j for j, c in enumerate(changes) if start_wall + c.time_s <= r["wall_start"]])
    result = {"schedule": args.schedule, "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
              "changes": [c._asdict() for c in changes], "lags": lags(rows, changes, start_wall),
              "steps": len(rows), "command": " ".join(["python", *sys.argv])}
    suffix = ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in rows for k in r}, key=lambda k: (k not in ("step", "t_s", "phase", "true_mbit"), k))
    write_csv(args.out_dir / f"adaptivity{suffix}.csv", [{k: r.get(k, "") for k in keys} for r in rows])
    (args.out_dir / f"adaptivity{suffix}.json").write_text(json.dumps(result, indent=2))
    plot(rows, changes, start_wall, args.out_dir / f"adaptivity{suffix}.png", len(args.buckets))
    _print_report(result, rows)
    return 0


def _print_report(result: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    settings = result["settings"]
    print(f"\n{result['steps']} steps; schedule {result['schedule']}; probe_every={settings['probe_every']}, "
          f"probe_sizes={settings['probe_sizes']}, forgetting={settings['forgetting'] or 'library default'}")
    for e in result["lags"]:
        print(f"change at {e['change_s']:.1f} s: {e['from_mbit']:g} -> {e['to_mbit']:g} Mbit/s ({e['phase_steps']} steps in phase)")
        for kind in ("allreduce", "allgather"):
            nom, st = e[kind]["to_nominal"], e[kind]["to_settled"]
            nom_txt = (f"{nom['steps']} steps / {nom['seconds']:.2f} s" if nom["reached"]
                       else f"not within 25% in the phase ({nom['steps']} steps)")
            print(f"  {kind:>9}: to nominal {nom_txt}; settled estimate {e[kind]['settled_mbit']:.0f} Mbit/s, "
                  f"reached (25%) after {st['steps']} steps / {st['seconds']:.2f} s")
    choices: dict[str, dict[str, int]] = {}
    for r in rows:
        for key, value in r.items():
            if key.endswith("_exchange"):
                label = f"{key[:-9]} ({r.get(key[:-9] + '_numel')} floats) @ phase {r['phase']} ({r['true_mbit']:g} Mbit/s)"
                choices.setdefault(label, {}).setdefault(value, 0)
                choices[label][value] += 1
    print("choices per bucket and phase:")
    for label, counts in choices.items():
        print(f"  {label}: {counts}")


if __name__ == "__main__":
    config = worker_config()
    if config is not None:
        worker_main(config)
    else:
        raise SystemExit(main())
