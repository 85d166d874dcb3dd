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

import argparse
import json
import math
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import switching
from collectives import RESULTS, median, require_emulation, run_job, write_csv
from flexcomm.netem import EmulatedCluster

STATIC = switching.STATIC
METHODS = switching.METHODS
NEAR = switching.NEAR


def case_row(n: int, rate: str, delay_ms: float, case: dict[str, Any]) -> dict[str, Any]:
    med = {m: median(case["samples"][m]) for m in METHODS}
    fastest = min(STATIC, key=lambda m: med[m])
    picks = Counter(case["flex_choices"])
    pick = picks.most_common(1)[0][0] if picks else "?"
    return {
        "rate": rate, "world_size": n, "bucket_floats": case["numel"], "density": case["density"],
        "delay_ms": delay_ms,
        **{f"{m}_s": med[m] for m in METHODS},
        **{f"{m}_steps": len(case["samples"][m]) for m in METHODS},
        "fastest": fastest, "flex_pick": pick, "flex_choices": "/".join(case["flex_choices"]),
        "flex_settle_choices": "/".join(c for _, c in case["flex_settle"]),
        "agree": pick == fastest, "pick_within_5pct": pick in med and med[pick] <= NEAR * med[fastest],
        "flex_over_best": med["flex"] / med[fastest],
        **{f"pred_{k}_s": v for k, v in case["flex_predicted"].items()},
        **{f"flex_alpha_{k}_ms": v * 1e3 for k, v in case["flex_alpha"].items()},
        **{f"flex_bw_{k}_mbit": (8 / b / 1e6 if b else math.inf) for k, b in case["flex_beta"].items()},
    }


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({(r["world_size"], r["bucket_floats"], r["density"]) for r in rows})
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.6), squeeze=False)
    colors = {"dense": "tab:blue", "agtopk": "tab:orange", "artopk": "tab:green"}
    markers = {"dense": "s", "agtopk": "^", "artopk": "o"}
    for ax, (n, numel, c) in zip(axes[0], groups):
        sel = sorted((r for r in rows if (r["world_size"], r["bucket_floats"], r["density"]) == (n, numel, c)),
                     key=lambda r: r["delay_ms"])
        x = [r["delay_ms"] for r in sel]
        for m in STATIC:
            ax.plot(x, [r[f"{m}_s"] * 1e3 for r in sel], "-", marker=markers[m], ms=4, color=colors[m],
                    label=f"{m} measured")
            ax.plot(x, [r[f"pred_{m}_s"] * 1e3 for r in sel], "--", color=colors[m], lw=1, label=f"{m} predicted")
        for r in sel:
            pick = r["flex_pick"]
            ax.plot([r["delay_ms"]], [r["flex_s"] * 1e3], marker=markers.get(pick, "x"), ms=13, mfc="none",
                    mec=colors.get(pick, "k"), mew=2)
            ax.annotate(("" if r["agree"] else "MISS ") + pick, (r["delay_ms"], r["flex_s"] * 1e3),
                        textcoords="offset points", xytext=(0, 9), ha="center", fontsize=7,
                        color="k" if r["agree"] else "tab:red")
        ax.plot([], [], "o", ms=11, mfc="none", mec="k", mew=2, label="flex (marker = its pick)")
        ax.set(xscale="symlog", yscale="log", xlabel="one-way delay (ms)", ylabel="ms / step",
               title=f"{sel[0]['rate']}, N={n}, M={numel / 2**20:g}Mi floats, c={c:g}")
        ax.set_xticks(x, [f"{v:g}" for v in x])
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: N=2, delays 0,16 ms, one bucket")
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delays-ms", default="0,1,5,16,32")
    parser.add_argument("--buckets", default="262144,1048576", help="bucket sizes in floats")
    parser.add_argument("--densities", default="0.01")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--flex-settle", type=int, default=4)
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--soft-seconds", type=float, default=3.0)
    parser.add_argument("--hard-seconds", type=float, default=8.0)
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    require_emulation()
    if args.quick:
        args.delays_ms, args.buckets, args.worlds = "0,16", "262144", "2"
    delays = [float(d) for d in args.delays_ms.split(",")]
    buckets = [int(float(b)) for b in args.buckets.split(",")]
    densities = [float(c) for c in args.densities.split(",")]
    worlds = [int(w) for w in args.worlds.split(",")]
    rows: list[dict[str, Any]] = []
    for n in worlds:
        with EmulatedCluster(n, args.rate, prefix="fcl", delay=True) as cluster:
            print(f"N={n}: delay backend {cluster.delay_backend}")
            for d in delays:
                cluster.set_delay(d / 1e3)
                cfg, total, seconds = switching.plan_job(args.rate, n, buckets, densities, args)
                # Planning: every step also pays a few round trips (alignment, agreement).
                seconds += total * 8 * d / 1e3
                cases = run_job(switching.__file__, cluster, n, cfg, total, f"{args.rate}/{d:g}ms N={n}",
                                timeout=4 * seconds + 300)
                rows += [case_row(n, args.rate, d, case) for case in cases]
    suffix = "_quick" if args.quick else ""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(args.out_dir / f"latency_switching{suffix}.csv", rows)
    summary = {
        "cases": len(rows),
        "agree_share": sum(r["agree"] for r in rows) / len(rows),
        "within_5pct_share": sum(r["pick_within_5pct"] for r in rows) / len(rows),
        "time_ratio": sum(r["flex_s"] for r in rows) / sum(min(r[f"{m}_s"] for m in STATIC) for r in rows),
        "misses": [{k: r[k] for k in ("world_size", "bucket_floats", "density", "delay_ms", "fastest", "flex_pick",
                                      "dense_s", "agtopk_s", "artopk_s", "flex_s")} for r in rows if not r["agree"]],
        "command": " ".join(["python", *sys.argv]),
    }
    (args.out_dir / f"latency_switching{suffix}.json").write_text(json.dumps(summary, indent=2))
    plot(rows, args.out_dir / f"latency_switching{suffix}.png")
    print("\ncase                         dense     agtopk    artopk    flex    | pred AG   pred AR  | alpha AR/AG ms | fastest  flex")
    for r in rows:
        print(f"  N={r['world_size']} M={r['bucket_floats']:>8} c={r['density']:<5g} d={r['delay_ms']:>4g}ms "
              f"{r['dense_s'] * 1e3:8.1f} {r['agtopk_s'] * 1e3:8.1f} {r['artopk_s'] * 1e3:8.1f} {r['flex_s'] * 1e3:8.1f} | "
              f"{r['pred_agtopk_s'] * 1e3:8.1f} {r['pred_artopk_s'] * 1e3:8.1f} | "
              f"{r['flex_alpha_allreduce_ms']:5.2f}/{r['flex_alpha_allgather_ms']:5.2f} | "
              f"{r['fastest']:>7} {r['flex_pick']:>7} {'ok' if r['agree'] else 'MISS'}")
    print(f"\nflex picked the measured-fastest exchange in {100 * summary['agree_share']:.1f}% of {summary['cases']} "
          f"cases (within 5%: {100 * summary['within_5pct_share']:.1f}%); flex total / best = {summary['time_ratio']:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
