"""The seeded part of ``e2e.py``: each method's mean and spread over seeds, and auto's ratios.

Per seed the target is 0.95 x that seed's dense best accuracy (``e2e.py`` passes it in).
For every method: time to target (training time, as ``summary.json``), final accuracy,
mean step time, over the seeds it ran; "spread" is min-max.  Auto's two goals, per seed and
over the seeds' means:

* time to target <= 1.15 x the fastest static setting's (the static compressed method with
  the shortest time to target that seed -- or, for the means, over the seeds' means);
* final accuracy >= dense's final accuracy - 1 point.

Writes ``results/<stem>.csv`` (one row per method), ``<stem>.md`` and ``<stem>.png``.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from typing import Any

from common import figure, save, write_csv
from runs import RESULTS, Run, fmt, md_table, time_to_target

TIME_GOAL = 1.15
ACCURACY_GOAL_PP = 1.0


def _spread(values: Sequence[float | None]) -> tuple[float | None, float | None, float | None, int]:
    """(mean, min, max, count) of the values that exist."""
    present = [v for v in values if v is not None]
    if not present:
        return None, None, None, 0
    return statistics.fmean(present), min(present), max(present), len(present)


def _per_seed(rs: Sequence[Run], target_of: Callable[[Run], float | None]) -> dict[int, dict[str, dict[str, Any]]]:
    """seed -> method -> {ttt, final, step_ms} for every loaded run."""
    table: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rs:
        target = target_of(r)
        ttt = time_to_target(r, target)[0] if target is not None else None
        table.setdefault(r.spec.seed, {})[r.spec.method] = {
            "ttt": ttt, "final": r.summary["final_accuracy"], "best": r.summary["best_accuracy"],
            "step_ms": r.summary["mean_step_time"] * 1e3, "target": target}
    return table


def _static(method: str) -> bool:
    return method != "dense" and " auto" not in method


def _auto_methods(methods: Sequence[str]) -> list[str]:
    return [m for m in methods if " auto" in m]


def auto_ratios(table: dict[int, dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per seed and auto method: its time to target over the fastest static setting's, its final accuracy minus dense's."""
    out = []
    for seed, by in sorted(table.items()):
        if "dense" not in by:
            continue
        reached = {m: v["ttt"] for m, v in by.items() if _static(m) and v["ttt"] is not None}
        fastest = min(reached, key=reached.get) if reached else None
        for auto in _auto_methods(list(by)):
            auto_ttt = by[auto]["ttt"]
            out.append({"seed": seed, "method": auto, "fastest_static": fastest,
                        "fastest_static_ttt_s": reached.get(fastest), "auto_ttt_s": auto_ttt,
                        "auto_over_fastest": auto_ttt / reached[fastest] if fastest and auto_ttt is not None else None,
                        "auto_minus_dense_final_pp": (by[auto]["final"] - by["dense"]["final"]) * 100})
    return out


def summarize(rs: Sequence[Run], target_of: Callable[[Run], float | None], label: str, stem: str) -> list[str]:
    """Write the seeded tables and figure of ``label``'s runs to ``<stem>.*``; return the headline lines."""
    if not rs:
        return [f"no seeded {label} runs"]
    table = _per_seed(rs, target_of)
    methods = list(dict.fromkeys(r.spec.method for r in rs))
    rows = []
    for m in methods:
        values = [by[m] for by in table.values() if m in by]
        ttt, final, step = (_spread([v[k] for v in values]) for k in ("ttt", "final", "step_ms"))
        row: dict[str, Any] = {"method": m, "seeds": len(values), "reached": ttt[3]}
        for key, (mean, low, high, _) in (("ttt_s", ttt), ("final", final), ("step_ms", step)):
            row.update({f"{key}_mean": mean, f"{key}_min": low, f"{key}_max": high})
        rows.append(row)
    ratios = auto_ratios(table)
    write_csv(RESULTS / f"{stem}.csv", rows, float_format=".6g")
    lines = headline(rows, ratios, label)
    write_md(rs, rows, ratios, lines, table, label, stem)
    plot(rows, stem)
    return lines


def headline(rows: Sequence[dict[str, Any]], ratios: Sequence[dict[str, Any]], label: str) -> list[str]:
    by = {r["method"]: r for r in rows}
    lines = [f"seeded {label}, 2 ranks: {len({r['seed'] for r in ratios})} seeds with dense and auto"]
    statics = {m: r["ttt_s_mean"] for m, r in by.items() if _static(m) and r["reached"] == r["seeds"]}
    for auto in _auto_methods(list(by)):
        mine = [r for r in ratios if r["method"] == auto]
        per_seed = [r["auto_over_fastest"] for r in mine]
        if per_seed and all(x is not None for x in per_seed):
            lines.append(f"  {auto}: time to target / fastest static's, per seed: " + ", ".join(
                f"{x:.2f} (vs {r['fastest_static']})" for x, r in zip(per_seed, mine))
                + f"; mean {statistics.fmean(per_seed):.2f} (goal <= {TIME_GOAL})")
        elif mine:
            lines.append(f"  {auto} or every static setting missed the target in some seed: " + ", ".join(
                f"seed {r['seed']}: auto {fmt(r['auto_ttt_s'], '.1f')} s, fastest static {r['fastest_static']}"
                for r in mine))
        if statics and by[auto]["ttt_s_mean"] is not None and by[auto]["reached"] == by[auto]["seeds"]:
            fastest = min(statics, key=statics.get)
            lines.append(f"  {auto} over the seeds' means: {by[auto]['ttt_s_mean']:.1f} s / {fastest} "
                         f"{statics[fastest]:.1f} s = {by[auto]['ttt_s_mean'] / statics[fastest]:.2f}")
        diffs = [r["auto_minus_dense_final_pp"] for r in mine]
        if diffs:
            lines.append(f"  {auto} final accuracy minus dense's (pp), per seed: " + ", ".join(f"{d:+.1f}" for d in diffs)
                         + f"; mean {statistics.fmean(diffs):+.1f} (goal >= -{ACCURACY_GOAL_PP:g})")
    return lines


def write_md(rs: Sequence[Run], rows: Sequence[dict[str, Any]], ratios: Sequence[dict[str, Any]], lines: Sequence[str],
             table: dict[int, dict[str, dict[str, Any]]], label: str, stem: str) -> None:
    def cell(r: dict[str, Any], key: str, spec: str) -> str:
        return f"{fmt(r[key + '_mean'], spec)} ({fmt(r[key + '_min'], spec)}-{fmt(r[key + '_max'], spec)})"

    header = ["method", "seeds", "reached target", "time to target, s: mean (min-max)", "final acc: mean (min-max)",
              "mean step, ms: mean (min-max)"]
    body = [[r["method"], str(r["seeds"]), str(r["reached"]), cell(r, "ttt_s", ".1f"), cell(r, "final", ".3f"),
             cell(r, "step_ms", ".0f")] for r in rows]
    seed_header = ["seed", "auto method", "target", "fastest static", "its time (s)", "auto time (s)", "auto / fastest",
                   "auto - dense final (pp)"]
    seed_body = [[str(r["seed"]), r["method"], fmt(next(iter(table[r["seed"]].values()))["target"], ".3f"), str(r["fastest_static"]),
                  fmt(r["fastest_static_ttt_s"], ".1f"), fmt(r["auto_ttt_s"], ".1f"), fmt(r["auto_over_fastest"], ".2f"),
                  f"{r['auto_minus_dense_final_pp']:+.1f}"] for r in ratios]
    text = ["# End-to-end over seeds: density=auto vs dense and static densities", "",
            f"{label}, 2 ranks, {rs[0].spec.n_steps} steps, schedule `{rs[0].spec.schedule}`, seeds "
            + ", ".join(str(s) for s in sorted(table))
            + f" (see `e2e.py`; run directories `{rs[0].spec.model}-n2-iid-*-s<seed>-*`). "
            "Target per seed = 0.95 x that seed's dense best accuracy; time to target = training time to the first "
            f"evaluation at or above it (evaluations every {rs[0].spec.eval_every} steps).", "",
            md_table(header, body), "", md_table(seed_header, seed_body), "", "## Headline", "",
            *[f"    {line}" for line in lines], ""]
    (RESULTS / f"{stem}.md").write_text("\n".join(text))


def plot(rows: Sequence[dict[str, Any]], stem: str) -> None:
    fig, axes = figure(1, 2, figsize=(12, 4))
    names = [r["method"] for r in rows]
    for ax, key, label in ((axes[0][0], "ttt_s", "time to target (s)"), (axes[0][1], "final", "final accuracy")):
        means = [r[f"{key}_mean"] or 0.0 for r in rows]
        low = [m - (r[f"{key}_min"] or 0.0) for m, r in zip(means, rows)]
        high = [(r[f"{key}_max"] or 0.0) - m for m, r in zip(means, rows)]
        ax.bar(names, means, yerr=[low, high], capsize=4, color=["tab:red" if " auto" in n else "tab:gray" for n in names])
        ax.set(ylabel=label + " (mean, min-max over seeds)")
        ax.tick_params(axis="x", rotation=25)
        ax.grid(alpha=0.3, axis="y")
    axes[0][1].set_ylim(bottom=max(0.0, min((r["final_min"] or 1.0) for r in rows) - 0.05))
    save(fig, RESULTS / f"{stem}.png", dpi=100)
