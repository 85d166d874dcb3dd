"""Does ``flex`` pick the fastest exchange?  A sweep over link rate, density, bucket size and N.

    python benchmarks/switching.py [--quick] [--rates 1gbit,100mbit,10mbit] [--densities 0.1,0.01,0.001]
                                   [--buckets 1000000,8000000] [--worlds 2,4] [--out-dir benchmarks/results]

For every case (rate, N, bucket of M floats, density c) the ranks run DDP over one
:class:`GradientInjector` parameter of M floats (one bucket: ``bucket_cap_mb`` above its
size) with flexcomm's hook, and measure the per-step time (forward + backward, ranks lined
up before each step, max over ranks) of

* the static exchanges ``dense``, ``agtopk`` and ``artopk-star`` at density c, and
* ``flex`` at density c (``flex_interval=2``, default probes): it first gets
  ``--flex-settle`` steps to probe and agree, then its steps are measured like the others';
  what it chose in the measured steps is recorded with the model's predictions.

The four run side by side: each round gives every method one step, in an order rotated
from round to round.  A method gets 3-5 measured steps (fewer when its steps are slow:
it stops once its steps add up to ``--soft-seconds`` after 3 steps, or ``--hard-seconds``
after 1); a method's time is the median of its steps.  ``dense`` does not depend on c, so
its steps are pooled over the densities of a bucket (its budget is per bucket).  One job
(one launch of N ranks inside an :class:`flexcomm.netem.EmulatedCluster`) per (rate, N).

Reported: the share of cases where flex picked the measured-fastest static exchange
(target >= 95%), the share where its pick was within 5% of the fastest, and
``sum(flex) / sum(best static)`` over the cases (target <= 1.05).

Then, on loopback (no shaping), the overhead of flex where dense is best: a bucket of
``--loopback-bucket`` floats at density 0.1, flex vs plain DDP (no hook, DDP's built-in
allreduce) vs the dense hook, ``--loopback-steps`` interleaved steps each after warm-up
(target flex / plain DDP <= 1.05).

Writes ``switching.csv``, ``switching_loopback.csv``, ``switching.json`` (summary) and
``switching.png`` to ``--out-dir``; ``--only-loopback`` runs just the loopback comparison
(``switching_loopback_only.{csv,json}``).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import common
from common import COMPRESSOR_OF, EXCHANGE_COLORS, median
from flexcomm.netem import parse_rate

STATIC = ("dense", "agtopk", "artopk")
METHODS = (*STATIC, "flex")
FLEX_INTERVAL = 2
NEAR = 1.05


# ============================================================================ worker
class Budget:
    """When a method has been measured enough: 3..``max_steps`` steps, fewer when slow."""

    def __init__(self, min_steps: int, max_steps: int, soft_s: float, hard_s: float) -> None:
        self.min_steps, self.max_steps, self.soft_s, self.hard_s = min_steps, max_steps, soft_s, hard_s
        self.count, self.seconds = 0, 0.0

    def wants_more(self) -> bool:
        if self.count >= self.max_steps:
            return False
        if self.count >= 1 and self.seconds >= self.hard_s:
            return False
        return self.count < self.min_steps or self.seconds < self.soft_s

    def add(self, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds


def _agreed_step(model: Any, grad: Any) -> float:
    """One aligned step; the max over ranks of its time (every rank gets the same number)."""
    return common.max_over_ranks([common.aligned_seconds(lambda: common.train_step(model, grad))])[0]


def _last_choice(state: Any) -> str:
    records = state.drain_records()
    return records[-1].exchange if records else "?"


def _flex_predictions(state: Any, density: float, world: int) -> dict[str, float]:
    """What flex's model predicts now for each exchange of the (one) bucket: blocking local work + communication."""
    return {e: float(state.chooser.predicted(0, e, density, world)) for e in STATIC}


def _run_case(cfg: dict[str, Any], numel: int, density: float, grad: Any, dense: tuple[Any, Any],
              dense_budget: Budget, world: int) -> dict[str, Any]:
    """Measure the four methods of one case side by side; returns this case's samples."""
    models = {"dense": dense}
    for method in ("agtopk", "artopk", "flex"):
        extra = {"flex_interval": FLEX_INTERVAL} if method == "flex" else {}
        models[method] = common.hooked_ddp(numel, COMPRESSOR_OF[method], density, **extra)
    for method in ("agtopk", "artopk"):
        common.train_step(models[method][0], grad)  # warm-up
        models[method][1].drain_records()
    settle = []
    for _ in range(cfg["flex_settle"]):
        settle.append((_agreed_step(models["flex"][0], grad), _last_choice(models["flex"][1])))
        common.progress()
    budgets = {m: Budget(3, cfg["max_steps"], cfg["soft_s"], cfg["hard_s"]) for m in ("agtopk", "artopk", "flex")}
    budgets["dense"] = dense_budget
    samples: dict[str, list[float]] = {m: [] for m in METHODS}
    choices: list[str] = []
    rnd = 0
    while any(b.wants_more() for b in budgets.values()):
        order = METHODS[rnd % 4:] + METHODS[: rnd % 4]
        for method in order:
            if not budgets[method].wants_more():
                continue
            seconds = _agreed_step(models[method][0], grad)
            budgets[method].add(seconds)
            samples[method].append(seconds)
            if method == "flex":
                choices.append(_last_choice(models["flex"][1]))
            elif method != "dense":
                models[method][1].drain_records()
            common.progress()
        rnd += 1
    flex_state = models["flex"][1]
    predicted = _flex_predictions(flex_state, density, world)
    params = flex_state.chooser.params
    del models
    gc.collect()
    return {"numel": numel, "density": density, "samples": samples, "flex_choices": choices,
            "flex_settle": settle, "flex_predicted": predicted,
            "flex_beta": {"allreduce": params.allreduce.beta, "allgather": params.allgather.beta,
                          "broadcast": params.broadcast.beta},
            "flex_alpha": {"allreduce": params.allreduce.alpha, "allgather": params.allgather.alpha,
                           "broadcast": params.broadcast.alpha}}


def sweep_worker(cfg: dict[str, Any]) -> list[dict[str, Any]]:
    """All cases of one (rate, N) job; dense is built once per bucket and pooled over densities."""
    _, world = common.init_worker()
    cases = []
    for numel in cfg["buckets"]:
        grad = common.rank_gradient(numel)
        dense = common.hooked_ddp(numel, "dense", 1.0)
        if cfg["dense_warmup"][str(numel)]:
            common.train_step(dense[0], grad)
        dense[1].drain_records()
        dense_budget = Budget(3, 3 * cfg["max_steps"], 2 * cfg["soft_s"], cfg["hard_s"])
        for density in cfg["densities"]:
            cases.append(_run_case(cfg, numel, density, grad, dense, dense_budget, world))
        del dense, grad
        gc.collect()
    return cases


def loopback_worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Flex vs plain DDP vs the dense hook on one large bucket, interleaved."""
    _, world = common.init_worker()
    numel, density = cfg["bucket"], cfg["density"]
    grad = common.rank_gradient(numel)
    models = {"plain_ddp": common.hooked_ddp(numel, None, density), "dense_hook": common.hooked_ddp(numel, "dense", density),
              "flex": common.hooked_ddp(numel, "flex", density, flex_interval=FLEX_INTERVAL)}
    for _ in range(cfg["flex_settle"]):
        common.train_step(models["flex"][0], grad)
    for name in ("plain_ddp", "dense_hook"):
        for _ in range(2):
            common.train_step(models[name][0], grad)
    names = list(models)
    samples: dict[str, list[float]] = {n: [] for n in names}
    choices = []
    for rnd in range(cfg["steps"]):
        for name in names[rnd % 3:] + names[: rnd % 3]:
            samples[name].append(_agreed_step(models[name][0], grad))
            if name == "flex":
                choices.append(_last_choice(models["flex"][1]))
            common.progress()
    return {"samples": samples, "flex_choices": choices,
            "flex_predicted": _flex_predictions(models["flex"][1], density, world)}


def worker_main(cfg: dict[str, Any]) -> None:
    common.finish_worker(cfg, loopback_worker(cfg) if cfg["mode"] == "loopback" else sweep_worker(cfg))


# ============================================================================ launcher
def plan_job(rate: str, n: int, buckets: Sequence[int], densities: Sequence[float], args: argparse.Namespace
             ) -> tuple[dict[str, Any], int, float]:
    """The worker config of one (rate, N) job, a progress total and a rough duration."""
    params = common.nominal_params(rate)
    warm = {str(m): common.nominal_exchange_seconds("dense", m, 1.0, n, params) < 5.0 for m in buckets}
    cfg = {"mode": "sweep", "buckets": list(buckets), "densities": list(densities), "flex_settle": args.flex_settle,
           "max_steps": args.max_steps, "soft_s": args.soft_seconds, "hard_s": args.hard_seconds,
           "dense_warmup": warm}
    total, seconds = 0, 0.0
    for m in buckets:
        dense_s = common.nominal_exchange_seconds("dense", m, 1.0, n, params)
        d_steps = _steps_within(dense_s, 3 * args.max_steps, 2 * args.soft_seconds, args.hard_seconds)
        seconds += dense_s * (d_steps + warm[str(m)])
        total += d_steps
        for c in densities:
            per = {e: common.nominal_exchange_seconds(e, m, c, n, params) for e in ("agtopk", "artopk")}
            flex_s = min(dense_s, *per.values())
            for e, s in per.items():
                k = _steps_within(s, args.max_steps, args.soft_seconds, args.hard_seconds)
                seconds += s * (k + 1)
                total += k
            k = _steps_within(flex_s, args.max_steps, args.soft_seconds, args.hard_seconds)
            seconds += flex_s * (k + args.flex_settle) + 0.5
            total += k + args.flex_settle
    return cfg, total, seconds


def _steps_within(step_s: float, max_steps: int, soft_s: float, hard_s: float) -> int:
    """How many steps a :class:`Budget` allows at a constant step time."""
    budget = Budget(3, max_steps, soft_s, hard_s)
    while budget.wants_more():
        budget.add(step_s)
    return budget.count


def case_row(rate: str, n: int, case: dict[str, Any], dense_samples: Sequence[float]) -> dict[str, Any]:
    """One case's row: medians, the fastest static exchange, flex's pick, time and model.

    ``dense_samples``: dense's step times for this case (pooled over the densities of a bucket).
    """
    med = {m: median(case["samples"][m]) for m in METHODS}
    med["dense"] = median(dense_samples)
    fastest = min(STATIC, key=lambda m: med[m])
    picks = Counter(case["flex_choices"])
    pick = picks.most_common(1)[0][0] if picks else "?"
    steps = {m: len(case["samples"][m]) for m in METHODS}
    return {
        "rate": rate, "world_size": n, "bucket_floats": case["numel"], "density": case["density"],
        **{f"{m}_s": med[m] for m in METHODS},
        **{f"{m}_steps": steps[m] for m in METHODS}, "dense_steps": len(dense_samples),
        "fastest": fastest, "flex_pick": pick,
        "flex_choices": "/".join(case["flex_choices"]),
        "flex_settle_choices": "/".join(c for _, c in case["flex_settle"]),
        "agree": pick == fastest,
        "pick_within_5pct": pick in med and med[pick] <= NEAR * med[fastest],
        "flex_over_best": med["flex"] / med[fastest],
        **{f"flex_pred_{k}_s": v for k, v in case["flex_predicted"].items()},
        **{f"flex_alpha_{k}_ms": v * 1e3 for k, v in case["flex_alpha"].items()},
        **{f"flex_bw_{k}_mbit": common.bandwidth_mbit(b) for k, b in case["flex_beta"].items()},
    }


def case_rows(rate: str, n: int, cases: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per case of a sweep job; dense's steps are pooled over the densities of a bucket."""
    pooled_dense: dict[int, list[float]] = {}
    for case in cases:
        pooled_dense.setdefault(case["numel"], []).extend(case["samples"]["dense"])
    return [case_row(rate, n, case, pooled_dense[case["numel"]]) for case in cases]


def summarize(rows: Sequence[dict[str, Any]], case_keys: Sequence[str] = ("rate", "world_size", "bucket_floats",
                                                                          "density")) -> dict[str, Any]:
    """The headline figures over all cases; ``case_keys`` name a case in the list of disagreements."""
    total_flex = sum(r["flex_s"] for r in rows)
    total_best = sum(min(r[f"{m}_s"] for m in STATIC) for r in rows)
    return {
        "cases": len(rows),
        "agree_share": sum(r["agree"] for r in rows) / len(rows),
        "within_5pct_share": sum(r["pick_within_5pct"] for r in rows) / len(rows),
        "flex_total_s": total_flex,
        "best_total_s": total_best,
        "time_ratio": total_flex / total_best,
        "median_flex_over_best": median([r["flex_over_best"] for r in rows]),
        "disagreements": [
            {k: r[k] for k in (*case_keys, "fastest", "flex_pick", "dense_s", "agtopk_s", "artopk_s", "flex_s")}
            for r in rows if not r["agree"]],
    }


def print_summary(summary: dict[str, Any]) -> None:
    print(f"\nflex picked the measured-fastest exchange in {100 * summary['agree_share']:.1f}% of "
          f"{summary['cases']} cases (within 5% of the fastest: {100 * summary['within_5pct_share']:.1f}%)")
    print(f"flex total / sum of per-case best = {summary['flex_total_s']:.2f} s / {summary['best_total_s']:.2f} s "
          f"= {summary['time_ratio']:.3f}")


def add_budget_arguments(parser: argparse.ArgumentParser, soft_seconds: float, hard_seconds: float) -> None:
    """Options of the sweep worker's per-method step budget (see :class:`Budget`)."""
    parser.add_argument("--flex-settle", type=int, default=4, help="flex steps before its steps are measured")
    parser.add_argument("--max-steps", type=int, default=5)
    parser.add_argument("--soft-seconds", type=float, default=soft_seconds)
    parser.add_argument("--hard-seconds", type=float, default=hard_seconds)


def loopback_rows(n: int, result: dict[str, Any], bucket: int, density: float) -> dict[str, Any]:
    """Medians of the loopback comparison and the flex / plain-DDP ratio."""
    med = {k: median(v) for k, v in result["samples"].items()}
    choices = Counter(result["flex_choices"])
    return {"world_size": n, "bucket_floats": bucket, "density": density, "steps": len(result["samples"]["flex"]),
            **{f"{k}_s": v for k, v in med.items()},
            "flex_over_plain": med["flex"] / med["plain_ddp"], "dense_hook_over_plain": med["dense_hook"] / med["plain_ddp"],
            "flex_choices": dict(choices), **{f"flex_pred_{k}_s": v for k, v in result["flex_predicted"].items()}}


def plot(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Per-step time of every method per case; one panel per (rate, N); flex's pick marked."""
    groups = sorted({(r["rate"], r["world_size"]) for r in rows}, key=lambda g: (-parse_rate(g[0]), g[1]))
    cols = len({g[1] for g in groups})
    nrows = math.ceil(len(groups) / cols)
    fig, axes = common.figure(nrows, cols, figsize=(7 * cols, 3.6 * nrows))
    for ax, (rate, n) in zip(axes.flat, groups):
        sel = [r for r in rows if (r["rate"], r["world_size"]) == (rate, n)]
        for j, m in enumerate(METHODS):
            xs = [i + (j - 1.5) * 0.2 for i in range(len(sel))]
            ax.bar(xs, [r[f"{m}_s"] for r in sel], width=0.2, color=EXCHANGE_COLORS[m], label=m)
        for i, r in enumerate(sel):
            mark = "*" if r["agree"] else "x"
            ax.text(i, r["flex_s"] * 1.15, f"{mark}{r['flex_pick']}", ha="center", fontsize=6)
        ax.set_xticks(range(len(sel)), [f"{r['bucket_floats'] / 1e6:g}M\nc={r['density']:g}" for r in sel],
                      fontsize=7)
        ax.set(yscale="log", ylabel="s / step", title=f"{rate}, N={n} (text: flex's pick, * = fastest)")
    axes.flat[0].legend(fontsize=7)
    for ax in list(axes.flat)[len(groups):]:
        ax.axis("off")
    common.save(fig, path)


def run_loopback(args: argparse.Namespace, worlds: Sequence[int]) -> list[dict[str, Any]]:
    """Flex vs plain DDP vs the dense hook on loopback, one job per N."""
    loop = []
    for n in worlds:
        cfg = {"mode": "loopback", "bucket": args.loopback_bucket, "density": args.loopback_density,
               "steps": args.loopback_steps, "flex_settle": args.flex_settle}
        result = common.run_job(__file__, None, n, cfg, 3 * args.loopback_steps, f"loopback N={n}", timeout=900)
        loop.append(loopback_rows(n, result, args.loopback_bucket, args.loopback_density))
    return loop


def loopback_only(args: argparse.Namespace) -> int:
    """Only the loopback comparison (e.g. with more steps than the full run's)."""
    loop = run_loopback(args, common.numbers(args.worlds, int))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    common.write_csv(args.out_dir / "switching_loopback_only.csv",
              [{**r, "flex_choices": json.dumps(r["flex_choices"])} for r in loop])
    (args.out_dir / "switching_loopback_only.json").write_text(json.dumps(
        {"loopback": loop, "command": common.command_line()}, indent=2))
    _print_loopback(loop)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.argument_parser(__doc__, "smoke run: 1gbit+100mbit, N=2, 1M floats, two densities",
                                    rates="1gbit,100mbit,10mbit", densities="0.1,0.01,0.001",
                                    buckets="1000000,8000000", worlds="2,4")
    add_budget_arguments(parser, soft_seconds=5.0, hard_seconds=12.0)
    parser.add_argument("--loopback-bucket", type=int, default=8_000_000)
    parser.add_argument("--loopback-density", type=float, default=0.1)
    parser.add_argument("--loopback-steps", type=int, default=15)
    parser.add_argument("--only-loopback", action="store_true",
                        help="skip the sweep; write switching_loopback_only.{csv,json}")
    args = parser.parse_args(argv)
    if args.only_loopback:
        return loopback_only(args)
    common.require_emulation()
    if args.quick:
        args.rates, args.densities, args.buckets, args.worlds = "1gbit,100mbit", "0.1,0.001", "1000000", "2"
        args.loopback_steps, args.loopback_bucket = 5, 2_000_000
    suffix = "_quick" if args.quick else ""
    rates, densities = args.rates.split(","), common.numbers(args.densities)
    buckets, worlds = common.numbers(args.buckets, int), common.numbers(args.worlds, int)
    jobs = [(rate, n, *plan_job(rate, n, buckets, densities, args)) for n in worlds for rate in rates]
    print(f"{len(jobs)} sweep jobs, {len(jobs) * len(buckets) * len(densities)} cases, roughly "
          f"{sum(j[4] for j in jobs) / 60:.0f} min of steps")
    rows: list[dict[str, Any]] = []
    for rate, n, cfg, total, seconds in jobs:
        with common.network(rate, n, "fcs") as cluster:
            cases = common.run_job(__file__, cluster, n, cfg, total, f"{rate} N={n}", timeout=4 * seconds + 600)
        rows += case_rows(rate, n, cases)
    loop = run_loopback(args, worlds)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    common.write_csv(args.out_dir / f"switching{suffix}.csv", rows)
    common.write_csv(args.out_dir / f"switching_loopback{suffix}.csv", [{**r, "flex_choices": json.dumps(r["flex_choices"])}
                                                                 for r in loop])
    summary = {**summarize(rows), "loopback": loop, "command": common.command_line()}
    (args.out_dir / f"switching{suffix}.json").write_text(json.dumps(summary, indent=2))
    plot(rows, args.out_dir / f"switching{suffix}.png")
    _print_report(rows, summary)
    return 0


def _print_report(rows: Sequence[dict[str, Any]], summary: dict[str, Any]) -> None:
    print("\ncase                               dense    agtopk   artopk   flex     fastest  flex-pick")
    for r in rows:
        print(f"  {r['rate']:>7} N={r['world_size']} M={r['bucket_floats'] / 1e6:g}M c={r['density']:<6g} "
              f"{r['dense_s']:8.4f} {r['agtopk_s']:8.4f} {r['artopk_s']:8.4f} {r['flex_s']:8.4f}  "
              f"{r['fastest']:>7}  {r['flex_pick']:>7} {'ok' if r['agree'] else 'MISS'}")
    print_summary(summary)
    _print_loopback(summary["loopback"])


def _print_loopback(loop: Sequence[dict[str, Any]]) -> None:
    for r in loop:
        print(f"loopback N={r['world_size']} M={r['bucket_floats'] / 1e6:g}M c={r['density']:g}: flex "
              f"{r['flex_s'] * 1e3:.1f} ms, plain DDP {r['plain_ddp_s'] * 1e3:.1f} ms, dense hook "
              f"{r['dense_hook_s'] * 1e3:.1f} ms -> flex / plain = {r['flex_over_plain']:.3f} "
              f"(flex chose {r['flex_choices']})")


if __name__ == "__main__":
    common.main_or_worker(main, worker_main)
