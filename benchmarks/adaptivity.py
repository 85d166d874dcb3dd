"""How fast does ``flex`` follow a bandwidth or latency change?  One run on 2 emulated hosts.

    python benchmarks/adaptivity.py [--quick] [--schedule 1gbit:20s,20mbit:20s,1gbit] [--last-phase 20]
                                    [--buckets 2000000] [--density 0.1] [--flex-interval N]
                                    [--probe-every N] [--probe-sizes B,B] [--forgetting F]
                                    [--tag TAG] [--out-dir benchmarks/results]
    python benchmarks/adaptivity.py --schedule "1gbit/1ms:20s,1gbit/16ms:20s,1gbit/1ms" \
                                    --buckets 2000000,250000 --tag latency

Two ranks, one per host of an :class:`flexcomm.netem.EmulatedCluster` whose link rate
follows ``--schedule`` (a :class:`flexcomm.netem.ScheduleRunner`, started when both ranks
are ready to step).  The ranks train a DDP model of :class:`GradientInjector`-style
parameters, one DDP bucket per entry of ``--buckets`` (floats), with the hook in ``flex``
mode until the last phase has lasted ``--last-phase`` seconds.  ``--flex-interval``,
``--probe-every``, ``--probe-sizes`` and ``--forgetting`` are passed to
:class:`flexcomm.FlexState` only when given: by default the run uses the library's defaults.  Per step (ranks lined up, time = max over ranks) it records
the wall-clock time, the step time, the exchange chosen for every bucket and the
estimated ``(alpha, beta)`` of allreduce, allgather and broadcast from
``state.chooser.params`` (what the decisions use; refreshed at agreement points and probes).

The true rate comes from the runner's ``changes`` (wall time = ``start_wall + time_s``).
Lag of each change: the steps and seconds from the change until the estimated
bandwidth ``8 / beta`` is first within 25% of the new nominal rate (and, since tbf's
burst and gloo's own speed move the effective rate away from the nominal one, until it
is within 25% of the estimate's own settled value in that phase: the median of the
phase's last third).

A schedule with delays (``"1gbit/1ms:20s,1gbit/16ms:20s,1gbit/1ms"``) is a latency run:
for every change of the delay it reports the lag until the step time, and until the
estimated alpha of allreduce / allgather / broadcast, first cross the midpoint between
the previous phase's settled value and this phase's (settled = median of a phase's last
third), and until alpha is within 25% of this phase's settled value; the plot then shows
the estimated alpha against the configured one-way delay.

Writes ``adaptivity.csv`` (per step), ``adaptivity.json`` (changes, lags, settings) and
``adaptivity.png`` (estimated bandwidth vs the true schedule, chosen exchange per bucket).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch.distributed as dist

import common
from common import median
from flexcomm.netem import EmulatedCluster, RateChange, ScheduleRunner, parse_schedule

READY = "@@ready"
KINDS = common.COLLECTIVES
WITHIN = 0.25


# ============================================================================ worker
def _estimates(state: Any) -> dict[str, float]:
    """flex's current (alpha, bandwidth) estimate of every collective kind."""
    params = state.chooser.params
    out = {}
    for kind in KINDS:
        link = params.link(kind)
        out[f"alpha_{kind}_s"] = link.alpha
        out[f"bw_{kind}_mbit"] = common.bandwidth_mbit(link.beta)
    return out


def worker_main(cfg: dict[str, Any]) -> None:
    """Step ``flex`` until ``duration_s`` after the ready signal; rank 0 writes the per-step log."""
    rank, world = common.init_worker()
    # DDP fills buckets in reverse parameter order with a 1 MiB first-bucket cap: with the
    # parameters listed small-to-large, the largest (>= 1 MiB) closes bucket 0 on its own
    # and the smaller ones follow in their own buckets (cap = the largest size).
    sizes = sorted(cfg["buckets"])
    overrides = {k: cfg[k] for k in ("flex_interval", "probe_every", "forgetting") if cfg[k] is not None}
    if cfg["probe_sizes"] is not None:
        overrides["probe_sizes"] = tuple(cfg["probe_sizes"])
    model, state = common.hooked_ddp(sizes, "flex", cfg["density"], **overrides)
    grad = common.rank_gradient(sum(sizes))
    for _ in range(2):  # the first probe, DDP's first-iteration work
        common.train_step(model, grad)
    state.drain_records()
    dist.barrier()
    if rank == 0:
        print(f"{READY} {time.time()}", flush=True)
    started = time.time()
    rows = []
    while True:
        step = state.step
        t0 = time.time()
        seconds = common.aligned_seconds(lambda: common.train_step(model, grad))
        records = state.drain_records()
        agreed_seconds, elapsed = common.max_over_ranks([seconds, time.time() - started])
        row = {"step": step, "wall_start": t0, "wall_end": t0 + agreed_seconds, "step_s": agreed_seconds,
               "probed": state.planner.probed_at == step, **_estimates(state)}
        for rec in records:
            row[f"bucket{rec.bucket}_numel"] = rec.numel
            row[f"bucket{rec.bucket}_exchange"] = rec.exchange
            row[f"bucket{rec.bucket}_t_exchange_s"] = rec.t_exchange
            row[f"bucket{rec.bucket}_predicted_s"] = rec.predicted
        rows.append(row)
        common.progress()
        if elapsed >= cfg["duration_s"]:
            break
    common.finish_worker(cfg, rows)


# ============================================================================ launcher
def run(args: argparse.Namespace, schedule: str, duration_s: float) -> tuple[list[dict[str, Any]], list[RateChange], float]:
    """Run the job; start the schedule when rank 0 reports ready.  Returns rows, changes, start wall."""
    cfg = {"buckets": args.buckets, "density": args.density, "flex_interval": args.flex_interval,
           "probe_every": args.probe_every, "probe_sizes": args.probe_sizes, "duration_s": duration_s,
           "forgetting": args.forgetting}
    runners: list[ScheduleRunner] = []
    with EmulatedCluster(2, schedule, prefix="fca") as cluster:
        def start_schedule(rank: int, line: str) -> None:
            if line.startswith(READY) and not runners:  # only rank 0 says it, once
                runners.append(cluster.start_schedule())

        rows = common.run_job(__file__, cluster, 2, cfg, None, "steps", timeout=duration_s * 4 + 600,
                              on_line=start_schedule)
        runner = runners[0]
        runner.stop()
        return rows, list(runner.changes), float(runner.start_wall or math.nan)


def in_force(wall: float, changes: Sequence[RateChange], start_wall: float, field: str) -> float:
    """The schedule's ``field`` (``rate_bps`` or ``delay_s``) in force at wall-clock time ``wall``.

    Before the runner's first change the cluster already runs at the first phase's settings
    (they are applied when the cluster starts).
    """
    value = getattr(changes[0], field) if changes else math.nan
    for c in changes:
        if start_wall + c.time_s <= wall:
            value = getattr(c, field)
    return value


def _first_step(after: Sequence[dict[str, Any]], reached: Callable[[dict[str, Any]], bool], change_wall: float
                ) -> dict[str, Any]:
    """Steps and seconds from a change until ``reached(row)`` first holds in ``after`` (the rows since it)."""
    for i, r in enumerate(after):
        if reached(r):
            return {"steps": i + 1, "seconds": r["wall_end"] - change_wall, "reached": True}
    return {"steps": len(after), "seconds": (after[-1]["wall_end"] - change_wall) if after else math.nan,
            "reached": False}


def _within(after: Sequence[dict[str, Any]], key: str, target: float, change_wall: float) -> dict[str, Any]:
    """Until ``key`` is first within 25% of ``target``."""
    return _first_step(after, lambda r: abs(r[key] - target) <= WITHIN * abs(target), change_wall)


def _crossing(after: Sequence[dict[str, Any]], key: str, old: float, new: float, change_wall: float
              ) -> dict[str, Any]:
    """Until ``key`` first passes the midpoint from ``old`` towards ``new``."""
    mid = (old + new) / 2
    return _first_step(after, lambda r: (r[key] - mid) * (new - old) >= 0, change_wall)


def lag(rows: Sequence[dict[str, Any]], change_wall: float, end_wall: float, kind: str, target_mbit: float
        ) -> dict[str, Any]:
    """Steps and seconds from a change until ``kind``'s estimate is within 25% of ``target_mbit``."""
    after = [r for r in rows if change_wall <= r["wall_start"] < end_wall]
    return _within(after, f"bw_{kind}_mbit", target_mbit, change_wall)


def lags(rows: Sequence[dict[str, Any]], changes: Sequence[RateChange], start_wall: float) -> list[dict[str, Any]]:
    """For every change after the first: lag to the nominal rate and to the phase's settled estimate."""
    out = []
    walls = [start_wall + c.time_s for c in changes] + [math.inf]
    for j in range(1, len(changes)):
        if changes[j].rate_bps == changes[j - 1].rate_bps:
            continue  # a delay-only change: see delay_lags
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


def _library_defaults() -> dict[str, Any]:
    """FlexState's defaults of the knobs this benchmark can override (recorded with the results)."""
    import inspect

    import flexcomm

    params = inspect.signature(flexcomm.FlexState.__init__).parameters
    return {k: params[k].default for k in ("flex_interval", "probe_every", "probe_sizes", "forgetting")}


def delay_lags(rows: Sequence[dict[str, Any]], changes: Sequence[RateChange], start_wall: float
               ) -> list[dict[str, Any]]:
    """For every change of the delay: lag of the step time and of the alpha estimates."""
    out = []
    walls = [start_wall + c.time_s for c in changes] + [math.inf]
    phases = [[r for r in rows if walls[j] <= r["wall_start"] < walls[j + 1]] for j in range(len(changes))]

    def settled(phase: Sequence[dict[str, Any]], key: str) -> float:
        return median([r[key] for r in phase[len(phase) * 2 // 3:]])

    for j in range(1, len(changes)):
        if changes[j].delay_s == changes[j - 1].delay_s:
            continue
        before, after = phases[j - 1], phases[j]
        entry: dict[str, Any] = {"change_s": changes[j].time_s, "from_delay_ms": changes[j - 1].delay_s * 1e3,
                                 "to_delay_ms": changes[j].delay_s * 1e3, "phase_steps": len(after)}
        keys = {"step": "step_s", **{kind: f"alpha_{kind}_s" for kind in KINDS}}
        for label, key in keys.items():
            old, new = settled(before, key), settled(after, key)
            entry[label] = {"settled_before": old, "settled_after": new,
                            "to_midpoint": _crossing(after, key, old, new, walls[j])}
            if label != "step":
                entry[label]["to_within_25pct_of_settled"] = _within(after, key, new, walls[j])
        out.append(entry)
    return out


class Panel(NamedTuple):
    """What the plot's top panel shows: flex's estimate against the schedule's true value."""

    estimate: str  # row key, with {kind}
    unit_scale: float  # row value -> plotted unit
    estimate_label: str
    truth: Callable[[RateChange], float]  # in the plotted unit
    truth_label: str
    ylabel: str
    yscale: str
    title: str
    step_scale: float  # step seconds -> the twin axis's unit
    step_label: str
    step_yscale: str


PANELS = {
    "rate": Panel("bw_{kind}_mbit", 1.0, "estimated ({kind})", lambda c: c.rate_bps / 1e6, "true rate (schedule)",
                  "Mbit/s", "log", "flex's estimated bandwidth (8/beta) vs the emulated link rate",
                  1.0, "step s (gray)", "log"),
    "delay": Panel("alpha_{kind}_s", 1e3, "estimated alpha ({kind})", lambda c: c.delay_s * 1e3,
                   "configured one-way delay (schedule)", "ms", "linear",
                   "flex's estimated alpha vs the emulated one-way delay", 1e3, "step ms (gray)", "linear"),
}


def plot(rows: Sequence[dict[str, Any]], changes: Sequence[RateChange], start_wall: float, path: Path,
         buckets: int, panel: Panel) -> None:
    """flex's estimate vs the true schedule (top), chosen exchange per bucket and step time (bottom)."""
    t = [r["wall_end"] - start_wall for r in rows]
    fig, (top, bottom) = common.figure(2, 1, figsize=(11, 7), sharex=True, squeeze=True,
                                       gridspec_kw={"height_ratios": [2, 1]})
    for kind in KINDS:
        top.plot(t, [r[panel.estimate.format(kind=kind)] * panel.unit_scale for r in rows], ".-", ms=3, lw=0.8,
                 color=common.COLLECTIVE_COLORS[kind],
                 label=panel.estimate_label.format(kind=kind))
    edges = [c.time_s for c in changes] + [t[-1] if t else 0.0]
    for c, (a, b) in zip(changes, zip(edges, edges[1:])):
        top.plot([a, b], [panel.truth(c)] * 2, "k-", lw=2)
    top.plot([], [], "k-", lw=2, label=panel.truth_label)
    for a in edges[1:-1]:
        top.axvline(a, color="gray", ls=":", lw=1)
        bottom.axvline(a, color="gray", ls=":", lw=1)
    top.set(yscale=panel.yscale, ylabel=panel.ylabel, title=panel.title)
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
    twin.plot(t, [r["step_s"] * panel.step_scale for r in rows], color="tab:gray", lw=0.6, alpha=0.6)
    twin.set(yscale=panel.step_yscale, ylabel=panel.step_label)
    bottom.legend(fontsize=8, loc="upper right")
    common.save(fig, path)


def main(argv: Sequence[str] | None = None) -> int:
    parser = common.argument_parser(__doc__, "smoke run: 1gbit:6s,20mbit:6s,1gbit for 6 s more")
    parser.add_argument("--schedule", default="1gbit:20s,20mbit:20s,1gbit")
    parser.add_argument("--last-phase", type=float, default=20.0, help="seconds of the last (open-ended) phase")
    parser.add_argument("--buckets", default="2000000", help="floats per DDP bucket (comma-separated: one bucket each)")
    parser.add_argument("--density", type=float, default=0.1)
    parser.add_argument("--flex-interval", type=int, default=None, help="default: the library's")
    parser.add_argument("--probe-every", type=int, default=None, help="default: the library's")
    parser.add_argument("--probe-sizes", default=None, help="bytes, comma-separated (default: the library's)")
    parser.add_argument("--forgetting", type=float, default=None,
                        help="the estimator's forgetting factor (default: the library's)")
    parser.add_argument("--tag", default="", help="suffix of the output files")
    args = parser.parse_args(argv)
    common.require_emulation()
    if args.quick:
        args.schedule, args.last_phase = "1gbit:6s,20mbit:6s,1gbit", 6.0
    args.buckets = common.numbers(args.buckets, int)
    if args.probe_sizes is not None:
        args.probe_sizes = common.numbers(args.probe_sizes, int)
    phases = parse_schedule(args.schedule)
    duration = sum(p.duration_s or 0.0 for p in phases) + args.last_phase
    rows, changes, start_wall = run(args, args.schedule, duration)
    for r in rows:
        r["true_mbit"] = in_force(r["wall_start"], changes, start_wall, "rate_bps") / 1e6
        r["true_delay_ms"] = in_force(r["wall_start"], changes, start_wall, "delay_s") * 1e3
        r["t_s"] = r["wall_start"] - start_wall
        r["phase"] = max([0] + [j for j, c in enumerate(changes) if start_wall + c.time_s <= r["wall_start"]])
    result = {"schedule": args.schedule, "settings": {k: v for k, v in vars(args).items() if k != "out_dir"},
              "library_defaults": _library_defaults(),
              "changes": [c._asdict() for c in changes], "lags": lags(rows, changes, start_wall),
              "delay_lags": delay_lags(rows, changes, start_wall),
              "steps": len(rows), "command": common.command_line()}
    suffix = ("_quick" if args.quick else "") + (f"_{args.tag}" if args.tag else "")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    keys = sorted({k for r in rows for k in r},
                  key=lambda k: (k not in ("step", "t_s", "phase", "true_mbit", "true_delay_ms"), k))
    common.write_csv(args.out_dir / f"adaptivity{suffix}.csv", [{k: r.get(k, "") for k in keys} for r in rows])
    (args.out_dir / f"adaptivity{suffix}.json").write_text(json.dumps(result, indent=2))
    panel = PANELS["delay" if any(c.delay_s != changes[0].delay_s for c in changes) else "rate"]
    plot(rows, changes, start_wall, args.out_dir / f"adaptivity{suffix}.png", len(args.buckets), panel)
    _print_report(result, rows)
    return 0


def _print_report(result: dict[str, Any], rows: Sequence[dict[str, Any]]) -> None:
    settings = result["settings"]
    lib = result["library_defaults"]
    knobs = ", ".join(f"{k}={settings[k] if settings[k] is not None else f'{lib[k]} (default)'}" for k in lib)
    print(f"\n{result['steps']} steps; schedule {result['schedule']}; {knobs}")
    for e in result["lags"]:
        print(f"change at {e['change_s']:.1f} s: {e['from_mbit']:g} -> {e['to_mbit']:g} Mbit/s ({e['phase_steps']} steps in phase)")
        for kind in ("allreduce", "allgather"):
            nom, st = e[kind]["to_nominal"], e[kind]["to_settled"]
            nom_txt = (f"{nom['steps']} steps / {nom['seconds']:.2f} s" if nom["reached"]
                       else f"not within 25% in the phase ({nom['steps']} steps)")
            print(f"  {kind:>9}: to nominal {nom_txt}; settled estimate {e[kind]['settled_mbit']:.0f} Mbit/s, "
                  f"reached (25%) after {st['steps']} steps / {st['seconds']:.2f} s")
    for e in result["delay_lags"]:
        print(f"delay change at {e['change_s']:.1f} s: {e['from_delay_ms']:g} -> {e['to_delay_ms']:g} ms "
              f"({e['phase_steps']} steps in phase)")
        for label in ("step", *KINDS):
            d = e[label]
            mid = d["to_midpoint"]
            txt = f"{mid['steps']} steps / {mid['seconds']:.2f} s" if mid["reached"] else f"not in the phase ({mid['steps']} steps)"
            extra = ""
            if "to_within_25pct_of_settled" in d:
                w = d["to_within_25pct_of_settled"]
                extra = (f"; within 25% of settled after {w['steps']} steps / {w['seconds']:.2f} s" if w["reached"]
                         else "; never within 25% of settled")
            unit = "step time" if label == "step" else f"alpha {label}"
            print(f"  {unit:>16}: settled {d['settled_before'] * 1e3:.2f} -> {d['settled_after'] * 1e3:.2f} ms; "
                  f"midpoint crossed after {txt}{extra}")
    choices: dict[str, dict[str, int]] = {}
    for r in rows:
        for key, value in r.items():
            if key.endswith("_exchange"):
                label = (f"{key[:-9]} ({r.get(key[:-9] + '_numel')} floats) @ phase {r['phase']} "
                         f"({r['true_mbit']:g} Mbit/s, {r['true_delay_ms']:g} ms)")
                choices.setdefault(label, {}).setdefault(value, 0)
                choices[label][value] += 1
    print("choices per bucket and phase:")
    for label, counts in choices.items():
        print(f"  {label}: {counts}")


if __name__ == "__main__":
    common.main_or_worker(main, worker_main)
