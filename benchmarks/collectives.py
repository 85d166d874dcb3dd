"""Measured vs predicted time of gloo collectives and of flexcomm's exchanges on emulated links.

    python benchmarks/collectives.py [--quick] [--rates 1gbit,100mbit,10mbit] [--worlds 2,4]
                                     [--max-op-seconds 10] [--out-dir benchmarks/results]

For every link rate (an :class:`flexcomm.netem.EmulatedCluster`, tbf-shaped bridge, one
rank per host) and world size N, one job times

* the collectives ``allreduce``, ``allgather`` (size = each rank's contribution) and
  ``broadcast`` from preallocated float32 buffers, and
* the three exchanges through the real hook (:func:`flexcomm.hook` in DDP, one bucket
  holding a :class:`GradientInjector` parameter of the message size, density
  ``--density``): ``dense``, ``agtopk`` and ``artopk`` (``artopk-star``),

at message sizes 1 KB..100 MB.  Sizes whose nominal time (cost model at the link rate)
exceeds ``--max-op-seconds`` are skipped and listed (at 10 Mbit that is everything above
~10 MB; at 100 Mbit the largest allgather/broadcast at N=4).

Timing, as all ranks see it: before every timed op the ranks line up with a one-float
allreduce; each rank times the op; the job keeps the **max over ranks** (one allreduce(MAX)
at the end), so a broadcast's early-returning root never counts.  Rounds interleave every
(kind, size) so slow phases of the shared machine hit all alike; each point is the median
of its repeats.  An exchange's communication time is ``max_r(t_compress + t_exchange) -
max_r(t_compress)`` from the hook's :class:`flexcomm.BucketRecord`: the span from the hook
receiving the bucket to the averaged result, less the top-k selection on the critical path.

Fit: per (rate, N, collective kind) an :class:`flexcomm.cost.AlphaBetaEstimator` with
``forgetting=1.0`` (plain least squares on relative error, prior worth 1e-6 samples) over
the median time of every size; the exchanges are then *predicted* from the three fitted
kinds with :func:`flexcomm.cost.predict_exchange_times` (not fitted themselves).
Reported: median ``|predicted - measured| / measured`` over sizes >= 1 MB (target <= 20%).
A second fit uses the sizes >= 1 MB only: tbf's token bucket (2 ms of line rate, 250 KB
at 1 Gbit) lets messages of up to a few hundred KB leave faster than the rate, which an
alpha-beta line through all sizes cannot follow; both fits are reported.

Writes ``collectives.csv`` (one row per measured point, predictions of both fits),
``collectives_fit.json`` (fitted alpha/beta per rate, N, kind, both fits; read by
``sim_check.py``), ``collectives_errors.csv`` and ``collectives.png`` (measured points,
lines of the all-sizes fit, log-log, one panel per rate).  ``--refit`` recomputes the
fits, errors and plot from the measured columns of an existing ``collectives.csv``.

The measurement is the op-timing job of ``common.py`` (:func:`op_timing.time_plan_worker`).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common
import op_timing
from common import COLLECTIVES, EXCHANGES, ONE_MB, median
from flexcomm.compress import k_for
from flexcomm.cost import CostParams, collective_time, predict_exchange_times
from flexcomm.netem import parse_rate

SIZES = (1e3, 1e4, 1e5, 3.16e5, 1e6, 3.16e6, 1e7, 3.16e7, 1e8)
QUICK_SIZES = (1e3, 1e5, 1e6, 4e6)


def predict_row(row: dict[str, Any], n: int, params: CostParams, density: float) -> float:
    """The model's time of one row's collective or exchange (communication only)."""
    if row["kind"] in COLLECTIVES:
        return collective_time(row["kind"], row["bytes"], n, params)
    return predict_exchange_times(row["bytes"] // 4, density, n, params)[row["kind"]]


def add_predictions(rate: str, n: int, rows: list[dict[str, Any]], density: float) -> dict[str, CostParams]:
    """Fit on all sizes (the spec) and on sizes >= 1 MB only; add both predictions to ``rows``."""
    fits = {"all": op_timing.fit_collectives(rows, n, rate), "ge1MB": op_timing.fit_collectives(rows, n, rate, ONE_MB)}
    for r in rows:
        r["payload_bytes"] = _payload_bytes(r["kind"], r["bytes"], density)
        for label, params in fits.items():
            tag = "" if label == "all" else "_ge1MB_fit"
            r[f"predicted{tag}_s"] = predict_row(r, n, params, density)
            r[f"rel_error{tag}"] = (r[f"predicted{tag}_s"] - r["measured_s"]) / r["measured_s"]
    return fits


def _payload_bytes(kind: str, nbytes: int, density: float) -> int:
    """Bytes a rank hands the backend: the message, or the exchange's compressed payload."""
    if kind in ("agtopk", "artopk"):
        return k_for(nbytes // 4, density) * 8
    return nbytes


def error_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median |rel error| per (rate, N, kind): sizes >= 1 MB and all sizes; both fits."""
    out = []
    keys = sorted({(r["rate"], r["world_size"], r["kind"]) for r in rows},
                  key=lambda k: (-parse_rate(k[0]), k[1], (*COLLECTIVES, *EXCHANGES).index(k[2])))
    for rate, n, kind in keys:
        sel = [r for r in rows if (r["rate"], r["world_size"], r["kind"]) == (rate, n, kind)]
        big = [r for r in sel if r["bytes"] >= ONE_MB]
        out.append({"rate": rate, "world_size": n, "kind": kind, "points_ge_1MB": len(big),
                    "median_abs_rel_err_ge_1MB": median([abs(r["rel_error"]) for r in big]),
                    "max_abs_rel_err_ge_1MB": max((abs(r["rel_error"]) for r in big), default=math.nan),
                    "median_abs_rel_err_all": median([abs(r["rel_error"]) for r in sel]),
                    "points_all": len(sel),
                    "median_abs_rel_err_ge_1MB_ge1MB_fit": median([abs(r["rel_error_ge1MB_fit"]) for r in big])})
    return out


def plot(rows: Sequence[dict[str, Any]], rates: Sequence[str], path: Path) -> None:
    """Measured points and predicted lines, log-log, one panel per rate."""
    colors = {**common.COLLECTIVE_COLORS, "dense": "tab:red", "agtopk": "tab:purple", "artopk": "tab:brown"}
    markers, styles = {2: "o", 4: "s"}, {2: "-", 4: "--"}
    fig, axes = common.figure(1, len(rates), figsize=(6 * len(rates), 5))
    for ax, rate in zip(axes[0], rates):
        for kind in (*COLLECTIVES, *EXCHANGES):
            for n in sorted({r["world_size"] for r in rows}):
                sel = sorted((r for r in rows if (r["rate"], r["kind"], r["world_size"]) == (rate, kind, n)),
                             key=lambda r: r["bytes"])
                if not sel:
                    continue
                x = [r["bytes"] for r in sel]
                ax.plot(x, [r["predicted_s"] for r in sel], styles[n], color=colors[kind], lw=1)
                ax.plot(x, [r["measured_s"] for r in sel], markers[n], color=colors[kind], ms=5,
                        mfc="none" if n == 4 else colors[kind], label=f"{kind} N={n}")
        ax.set(xscale="log", yscale="log", title=f"{rate}: measured (points) vs fitted model (lines)",
               xlabel="message bytes (allgather: per rank; exchanges: bucket bytes)", ylabel="seconds")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    common.save(fig, path)


def _fit_json(params: CostParams) -> dict[str, dict[str, float]]:
    return {k: {"alpha_s": v.alpha, "beta_s_per_byte": v.beta, "bandwidth_mbit": common.bandwidth_mbit(v.beta)}
            for k, v in ((kind, params.link(kind)) for kind in COLLECTIVES)}


def measure(args: argparse.Namespace, rates: Sequence[str], worlds: Sequence[int], sizes: Sequence[float]
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run one job per (rate, N); returns the measured points and the skipped ops."""
    jobs = [(rate, n, *op_timing.make_plan(rate, n, sizes, args.density, args.max_op_seconds))
            for n in worlds for rate in rates]
    print(f"{len(jobs)} jobs, nominal {sum(op_timing.plan_seconds(p) for *_, p, _ in jobs) / 60:.1f} min of ops")
    rows, skipped = [], []
    for rate, n, plan, skip in jobs:
        skipped += [{"rate": rate, "world_size": n, **{k: s[k] for k in ("op", "bytes", "est_s")}} for s in skip]
        raw = op_timing.run_plan(__file__, rate, n, plan, args.density, "fcc")
        rows += op_timing.point_rows(rate, n, plan, raw)
    return rows, skipped


def reload_points(path: Path) -> list[dict[str, Any]]:
    """The measured columns of an earlier ``collectives.csv`` (to refit without measuring again)."""
    with path.open() as f:
        return [{"rate": r["rate"], "world_size": int(r["world_size"]), "kind": r["kind"], "bytes": int(r["bytes"]),
                 "reps": int(r["reps"]), **{k: float(r[k]) for k in ("measured_s", "min_s", "compress_s", "step_wall_s")}}
                for r in csv.DictReader(f)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.argument_parser(__doc__, "smoke run: 1gbit+100mbit, N=2, four sizes", rates="1gbit,100mbit,10mbit",
                                    worlds="2,4")
    parser.add_argument("--density", type=float, default=0.1, help="density of the AG/AR exchanges")
    parser.add_argument("--max-op-seconds", type=float, default=10.0, help="skip ops whose nominal time exceeds this")
    parser.add_argument("--refit", action="store_true",
                        help="no measurement: refit and re-plot the measured points of an earlier run's CSV")
    args = parser.parse_args(argv)
    rates = ["1gbit", "100mbit"] if args.quick else args.rates.split(",")
    worlds = [2] if args.quick else common.numbers(args.worlds, int)
    suffix = "_quick" if args.quick else ""
    fit_path = args.out_dir / f"collectives_fit{suffix}.json"
    if args.refit:
        rows = reload_points(args.out_dir / f"collectives{suffix}.csv")
        previous = json.loads(fit_path.read_text())
        skipped, command = previous["skipped"], previous["command"] + "  (refit: " + " ".join(sys.argv) + ")"
    else:
        common.require_emulation()
        rows, skipped = measure(args, rates, worlds, QUICK_SIZES if args.quick else SIZES)
        command = common.command_line()
    fits, fits_large = {}, {}
    for rate, n in dict.fromkeys((r["rate"], r["world_size"]) for r in rows):
        job = [r for r in rows if (r["rate"], r["world_size"]) == (rate, n)]
        both = add_predictions(rate, n, job, args.density)
        fits[f"{rate}/N={n}"], fits_large[f"{rate}/N={n}"] = _fit_json(both["all"]), _fit_json(both["ge1MB"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    common.write_csv(args.out_dir / f"collectives{suffix}.csv", rows)
    errors = error_table(rows)
    common.write_csv(args.out_dir / f"collectives_errors{suffix}.csv", errors)
    fit_path.write_text(json.dumps({"fits": fits, "fits_ge1MB": fits_large, "density": args.density,
                                    "skipped": skipped, "command": command}, indent=2))
    plot(rows, list(dict.fromkeys(r["rate"] for r in rows)), args.out_dir / f"collectives{suffix}.png")
    _print_report(errors, fits, fits_large, skipped)
    return 0


def _print_report(errors: Sequence[dict[str, Any]], fits: dict[str, Any], fits_large: dict[str, Any],
                  skipped: Sequence[dict[str, Any]]) -> None:
    print("\nmedian |predicted - measured| / measured over sizes >= 1 MB (target <= 20%)")
    print("  fit on all sizes (spec)  |  fit on sizes >= 1 MB  |  all sizes, fit on all")
    for e in errors:
        flag = "ok  " if e["median_abs_rel_err_ge_1MB"] <= 0.20 else "MISS"
        print(f"  {flag} {e['rate']:>8} N={e['world_size']} {e['kind']:>9}: {100 * e['median_abs_rel_err_ge_1MB']:5.1f}% "
              f"(n={e['points_ge_1MB']}, max {100 * e['max_abs_rel_err_ge_1MB']:5.1f}%) | "
              f"{100 * e['median_abs_rel_err_ge_1MB_ge1MB_fit']:5.1f}% | {100 * e['median_abs_rel_err_all']:5.1f}%")
    for label, table in (("all sizes", fits), (">= 1 MB", fits_large)):
        print(f"\nfitted alpha / bandwidth (fit on {label})")
        for key, kinds in table.items():
            print("  " + key + ": " + ", ".join(f"{k} {v['alpha_s'] * 1e3:.3f} ms / {v['bandwidth_mbit']:.0f} Mbit/s"
                                                for k, v in kinds.items()))
    if skipped:
        print("\nskipped (nominal time > limit): " + "; ".join(
            f"{s['rate']} N={s['world_size']} {s['op']} {s['bytes'] / 1e6:g} MB ({s['est_s']:.0f} s)" for s in skipped))


if __name__ == "__main__":
    common.main_or_worker(main, op_timing.time_plan_worker)
