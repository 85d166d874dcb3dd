"""The AG-Topk vs AR-Topk crossover as latency rises: measured, predicted, and flex's choice.

    python benchmarks/latency_switching.py [--quick] [--rate 1gbit] [--delays-ms 0,1,5,16,32]
                                           [--buckets 262144,1048576] [--densities 0.01] [--worlds 2,4]
                                           [--out-dir benchmarks/results]

One :class:`flexcomm.netem.EmulatedCluster` per world size N at ``--rate`` with a delay path
(``delay=True``: netem, or the user-space switch where the kernel has no netem; the 0 ms
point goes through the same path).  For every one-way delay the launcher sets the delay
(:meth:`EmulatedCluster.set_delay`) and runs one job of ``switching.py``'s sweep worker:
every (bucket, density) case measures ``dense``, ``agtopk``, ``artopk-star`` and ``flex``
(library defaults except ``flex_interval=2``, as in ``switching.py``) side by side through
the hook, per-step time = max over ranks, median of 3-5 steps.

Predicted: flex's own cost model at the end of the case (its online (alpha, beta) per
collective kind plus its measured compression time), for every exchange.  Reported: the
share of cases where flex picked the measured-fastest static exchange (the oracle) and
where its pick was within 5% of it; flex's estimated alpha per kind against the delay.

Writes ``latency_switching.csv`` / ``.json`` / ``.png`` (measured lines, predicted dashed,
flex's time marked with its choice) to ``--out-dir``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common
import switching
from common import EXCHANGE_COLORS
from flexcomm.netem import EmulatedCluster

#: Marker of each static exchange (and of flex's pick).
MARKERS = {"dense": "s", "agtopk": "^", "artopk": "o"}


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    groups = sorted({(r["world_size"], r["bucket_floats"], r["density"]) for r in rows})
    fig, axes = common.figure(1, len(groups), figsize=(5.5 * len(groups), 4.6))
    for ax, (n, numel, c) in zip(axes[0], groups):
        sel = sorted((r for r in rows if (r["world_size"], r["bucket_floats"], r["density"]) == (n, numel, c)),
                     key=lambda r: r["delay_ms"])
        x = [r["delay_ms"] for r in sel]
        for m in switching.STATIC:
            ax.plot(x, [r[f"{m}_s"] * 1e3 for r in sel], "-", marker=MARKERS[m], ms=4, color=EXCHANGE_COLORS[m],
                    label=f"{m} measured")
            ax.plot(x, [r[f"flex_pred_{m}_s"] * 1e3 for r in sel], "--", color=EXCHANGE_COLORS[m], lw=1, label=f"{m} predicted")
        for r in sel:
            pick = r["flex_pick"]
            ax.plot([r["delay_ms"]], [r["flex_s"] * 1e3], marker=MARKERS.get(pick, "x"), ms=13, mfc="none",
                    mec=EXCHANGE_COLORS.get(pick, "k"), mew=2)
            ax.annotate(("" if r["agree"] else "MISS ") + pick, (r["delay_ms"], r["flex_s"] * 1e3),
                        textcoords="offset points", xytext=(0, 9), ha="center", fontsize=7,
                        color="k" if r["agree"] else "tab:red")
        ax.plot([], [], "o", ms=11, mfc="none", mec="k", mew=2, label="flex (marker = its pick)")
        ax.set(xscale="symlog", yscale="log", xlabel="one-way delay (ms)", ylabel="ms / step",
               title=f"{sel[0]['rate']}, N={n}, M={numel / 2**20:g}Mi floats, c={c:g}")
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    common.save(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.argument_parser(__doc__, "smoke run: N=2, delays 0,16 ms, one bucket", delays_ms="0,1,5,16,32",
                                    buckets="262144,1048576", densities="0.01", worlds="2,4")
    parser.add_argument("--rate", default="1gbit")
    switching.add_budget_arguments(parser, soft_seconds=3.0, hard_seconds=8.0)
    args = parser.parse_args(argv)
    common.require_emulation()
    if args.quick:
        args.delays_ms, args.buckets, args.worlds = "0,16", "262144", "2"
    delays, densities = common.numbers(args.delays_ms), common.numbers(args.densities)
    buckets, worlds = common.numbers(args.buckets, int), common.numbers(args.worlds, int)
    rows: list[dict[str, Any]] = []
    for n in worlds:
        with EmulatedCluster(n, args.rate, prefix="fcl", delay=True) as cluster:
            print(f"N={n}: delay backend {cluster.delay_backend}")
            for d in delays:
                cluster.set_delay(d / 1e3)
                cfg, total, seconds = switching.plan_job(args.rate, n, buckets, densities, args)
                # Planning: every step also pays a few round trips (alignment, agreement).
                seconds += total * 8 * d / 1e3
                cases = common.run_job(switching.__file__, cluster, n, cfg, total, f"{args.rate}/{d:g}ms N={n}",
                                       timeout=4 * seconds + 300)
                rows += [{**switching.case_row(args.rate, n, case, case["samples"]["dense"]), "delay_ms": d}
                         for case in cases]
    suffix = "_quick" if args.quick else ""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    common.write_csv(args.out_dir / f"latency_switching{suffix}.csv", rows)
    summary = {**switching.summarize(rows, ("world_size", "bucket_floats", "density", "delay_ms")),
               "command": common.command_line()}
    (args.out_dir / f"latency_switching{suffix}.json").write_text(json.dumps(summary, indent=2))
    plot(rows, args.out_dir / f"latency_switching{suffix}.png")
    print("\ncase                         dense     agtopk    artopk    flex    | pred AG   pred AR  | alpha AR/AG ms | fastest  flex")
    for r in rows:
        print(f"  N={r['world_size']} M={r['bucket_floats']:>8} c={r['density']:<5g} d={r['delay_ms']:>4g}ms "
              f"{r['dense_s'] * 1e3:8.1f} {r['agtopk_s'] * 1e3:8.1f} {r['artopk_s'] * 1e3:8.1f} {r['flex_s'] * 1e3:8.1f} | "
              f"{r['flex_pred_agtopk_s'] * 1e3:8.1f} {r['flex_pred_artopk_s'] * 1e3:8.1f} | "
              f"{r['flex_alpha_allreduce_ms']:5.2f}/{r['flex_alpha_allgather_ms']:5.2f} | "
              f"{r['fastest']:>7} {r['flex_pick']:>7} {'ok' if r['agree'] else 'MISS'}")
    switching.print_summary(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
