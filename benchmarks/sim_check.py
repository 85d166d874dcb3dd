"""Check :mod:`flexcomm.sim` against emulated measurements at N = 2 and 4.

    python benchmarks/sim_check.py [--quick] [--rates 1gbit,100mbit] [--worlds 2,4]
                                   [--params 11200000] [--densities 0.1,0.01] [--out-dir benchmarks/results]

The simulator predicts a step's communication time as the sum over DDP-like buckets
(:func:`flexcomm.sim.bucket_sizes`: a 1 MiB first bucket, then 25 MiB ones) of each
bucket's exchange time under the alpha-beta model (:func:`flexcomm.sim.step_comm_time`).
Here, for a model of ``--params`` parameters (default 11.2M, ResNet-18's size), every
distinct bucket of that bucketing is exchanged through the real hook on an emulated
cluster (same measurement as ``collectives.py``: ranks lined up, max over ranks,
communication = ``max_r(t_compress + t_exchange) - max_r(t_compress)``, median of
repeats), and the measured step communication time is the sum over the buckets.

The simulator is driven by (alpha, beta) fitted per collective kind

* ``this_run``: from collectives timed in the same job (1 KB .. 16 MB, least squares
  with ``forgetting=1.0``, as ``collectives.py`` does); ``this_run_ge1MB``: the same
  collectives, sizes >= 1 MB only (tbf's burst makes smaller messages faster than the
  rate, which pulls an all-sizes fit towards too much bandwidth);
* ``collectives.py`` / ``collectives.py_ge1MB``: the two fits in ``collectives_fit.json``
  of a full ``collectives.py`` run, when present (same rate and N);
* ``this_run_ge1MB_N=2``: the N = 2 fit (>= 1 MB) used to predict N = 4 (the
  simulator's real job: extrapolating in N).

Reported: ``(simulated - measured) / measured`` per (rate, N, density, exchange, fit).
Writes ``sim_check.csv`` and ``sim_check.png``.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common
import op_timing
from common import COLLECTIVES, EXCHANGES
from flexcomm.cost import CostParams, LinkParams
from flexcomm.netem import parse_rate
from flexcomm.sim import bucket_sizes, step_comm_time

FIT_SIZES = (1e3, 1e4, 1e5, 1e6, 4e6, 1.6e7)
QUICK_FIT_SIZES = (1e3, 1e5, 1e6, 4e6)


def make_plan(rate: str, n: int, buckets: Sequence[int], densities: Sequence[float], fit_sizes: Sequence[float],
              max_op_s: float) -> list[dict[str, Any]]:
    """Collectives to fit on, and every (bucket, density, exchange) to measure."""
    plan, _ = op_timing.make_plan(rate, n, fit_sizes, densities[0], max_op_s, ops=COLLECTIVES)
    params = common.nominal_params(rate)
    for numel in sorted(set(buckets)):
        for density in densities:
            for op in EXCHANGES:
                if op == "dense" and density != densities[0]:
                    continue  # dense does not depend on the density: measured once
                est = common.nominal_exchange_seconds(op, numel, density, n, params)
                plan.append(op_timing.plan_entry(op, numel * 4, est, density=density))
    return plan


def measured_exchanges(points: Sequence[dict[str, Any]]) -> dict[tuple[str, int, float], float]:
    """Median communication time per (exchange, bucket floats, density)."""
    return {(r["kind"], r["bytes"] // 4, r["density"]): r["measured_s"] for r in points if r["kind"] in EXCHANGES}


def from_collectives_json(path: Path, rate: str, n: int, key: str = "fits") -> CostParams | None:
    """A fit (``fits``: all sizes, ``fits_ge1MB``) of a full ``collectives.py`` run, if there is one."""
    if not path.exists():
        return None
    fits = json.loads(path.read_text()).get(key, {}).get(f"{rate}/N={n}")
    if fits is None:
        return None
    links = {k: LinkParams(v["alpha_s"], v["beta_s_per_byte"]) for k, v in fits.items()}
    return CostParams(links["allreduce"], links["allgather"], links["broadcast"])


def measured_step(measured: dict[tuple[str, int, float], float], exchange: str, buckets: Sequence[int],
                  density: float, dense_density: float) -> float:
    """Measured step communication: the sum of the buckets' exchange times."""
    d = dense_density if exchange == "dense" else density
    return sum(count * measured[(exchange, numel, d)] for numel, count in Counter(buckets).items())


def compare(rate: str, n: int, num_params: int, buckets: Sequence[int], densities: Sequence[float],
            measured: dict[tuple[str, int, float], float], fits: dict[str, CostParams]) -> list[dict[str, Any]]:
    """One row per (density, exchange, fit source)."""
    rows = []
    for density in densities:
        for exchange in EXCHANGES:
            meas = measured_step(measured, exchange, buckets, density, densities[0])
            for source, params in fits.items():
                sim = step_comm_time(num_params, n, params, exchange, density)  # type: ignore[arg-type]
                rows.append({"rate": rate, "world_size": n, "num_params": num_params, "buckets": len(buckets),
                             "density": density if exchange != "dense" else 1.0, "exchange": exchange,
                             "fit": source, "measured_s": meas, "simulated_s": sim,
                             "rel_error": (sim - meas) / meas})
    return rows


def dedupe(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Dense rows repeat once per density; keep the first."""
    seen, out = set(), []
    for r in rows:
        key = (r["rate"], r["world_size"], r["num_params"], r["density"], r["exchange"], r["fit"])
        if key not in seen:
            seen.add(key)
            out.append(r)
    return out


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Measured vs simulated step communication time, one panel per (rate, N)."""
    groups = sorted({(r["rate"], r["world_size"]) for r in rows}, key=lambda g: (-parse_rate(g[0]), g[1]))
    fig, axes = common.figure(1, len(groups), figsize=(5 * len(groups), 4))
    fits = list(dict.fromkeys(r["fit"] for r in rows))
    for ax, (rate, n) in zip(axes[0], groups):
        sel = [r for r in rows if (r["rate"], r["world_size"]) == (rate, n)]
        labels = list(dict.fromkeys(f"{r['exchange']}\nc={r['density']:g}" for r in sel))
        meas = {f"{r['exchange']}\nc={r['density']:g}": r["measured_s"] for r in sel}
        width = 0.8 / (len(fits) + 1)
        ax.bar([i - 0.4 + width / 2 for i in range(len(labels))], [meas[lab] for lab in labels], width,
               color="black", label="measured")
        for j, fit in enumerate(fits):
            vals = {f"{r['exchange']}\nc={r['density']:g}": r["simulated_s"] for r in sel if r["fit"] == fit}
            xs = [i - 0.4 + width * (j + 1.5) for i in range(len(labels))]
            ax.bar(xs, [vals.get(lab, math.nan) for lab in labels], width, label=f"sim ({fit})")
        ax.set_xticks(range(len(labels)), labels, fontsize=7)
        ax.set(yscale="log", ylabel="s per step (communication)", title=f"{rate}, N={n}")
    axes[0][0].legend(fontsize=7)
    common.save(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.argument_parser(__doc__, "smoke run: 1gbit, N=2, 2M params, density 0.1", rates="1gbit,100mbit",
                                    worlds="2,4", densities="0.1,0.01")
    parser.add_argument("--params", type=int, default=11_200_000, help="model size in parameters")
    parser.add_argument("--max-op-seconds", type=float, default=10.0)
    args = parser.parse_args(argv)
    common.require_emulation()
    if args.quick:
        args.rates, args.worlds, args.params, args.densities = "1gbit", "2", 2_000_000, "0.1"
    suffix = "_quick" if args.quick else ""
    rates, worlds, densities = args.rates.split(","), common.numbers(args.worlds, int), common.numbers(args.densities)
    buckets = bucket_sizes(args.params)
    fit_sizes = QUICK_FIT_SIZES if args.quick else FIT_SIZES
    print(f"{args.params:,} parameters -> buckets {buckets}")
    rows: list[dict[str, Any]] = []
    fits_n2: dict[str, CostParams] = {}
    for n in worlds:
        for rate in rates:
            plan = make_plan(rate, n, buckets, densities, fit_sizes, args.max_op_seconds)
            points = op_timing.point_rows(rate, n, plan, op_timing.run_plan(__file__, rate, n, plan, densities[0], "fcm"))
            measured = measured_exchanges(points)
            fits = {"this_run": op_timing.fit_collectives(points, n, rate),
                    "this_run_ge1MB": op_timing.fit_collectives(points, n, rate, common.ONE_MB)}
            for key, label in (("fits", "collectives.py"), ("fits_ge1MB", "collectives.py_ge1MB")):
                other = from_collectives_json(args.out_dir / "collectives_fit.json", rate, n, key)
                if other is not None:
                    fits[label] = other
            if n == 2:
                fits_n2[rate] = fits["this_run_ge1MB"]
            elif rate in fits_n2:
                fits["this_run_ge1MB_N=2"] = fits_n2[rate]
            rows += compare(rate, n, args.params, buckets, densities, measured, fits)
    rows = dedupe(rows)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    common.write_csv(args.out_dir / f"sim_check{suffix}.csv", rows)
    plot(rows, args.out_dir / f"sim_check{suffix}.png")
    _print_report(rows)
    print("command: " + common.command_line())
    return 0


def _print_report(rows: Sequence[dict[str, Any]]) -> None:
    print("\nsimulated vs measured step communication time")
    for r in rows:
        print(f"  {r['rate']:>7} N={r['world_size']} {r['exchange']:>6} c={r['density']:<5g} fit={r['fit']:<14} "
              f"measured {r['measured_s']:8.4f} s  sim {r['simulated_s']:8.4f} s  err {100 * r['rel_error']:+6.1f}%")
    for fit in dict.fromkeys(r["fit"] for r in rows):
        errs = [abs(r["rel_error"]) for r in rows if r["fit"] == fit]
        print(f"median |error| with fit {fit}: {100 * common.median(errs):.1f}% over {len(errs)} rows")


if __name__ == "__main__":
    common.main_or_worker(main, op_timing.time_plan_worker)
