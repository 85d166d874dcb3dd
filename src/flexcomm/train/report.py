"""``flexcomm-report DIR...``: plots and a Markdown table from ``flexcomm-train`` run directories.

Written into the first directory (or ``--out``):

``accuracy.png``   test accuracy against time (evaluation excluded) and against step, every run on one plot;
``step_time.png``  where a step's time goes (compute, compression, waiting for
                   communication, optimizer; the paper's Fig. 1a) and step time over
                   the run, with the emulated network's rate changes;
``gain.png``       compression gain over training (Fig. 3) and, for ``flex`` runs that sent low-rank
                   factors, the measured quality ``cos(update, mean gradient)``; runs that record them;
``leaders.png``    share of AR-Topk index-source selections per rank (Fig. 4, STAR vs VAR);
``summary.md``     one table row per run.

A run without ``summary.json`` (it crashed or is still running) is summarised from its
records and marked incomplete.  Figures are drawn with matplotlib's object API on the
Agg canvas: no display and no pyplot global state.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from flexcomm.train.records import NETWORK_FILE, RECORDS_FILE, read_records, read_summary, summarize


@dataclass
class Run:
    """One run directory, loaded."""

    path: Path
    name: str
    records: list[dict[str, Any]]
    summary: dict[str, Any]
    network: dict[str, Any] | None
    complete: bool

    @property
    def config(self) -> dict[str, Any]:
        return self.summary.get("config") or _read_json(self.path / "config.json") or {}


def load_run(path: Path) -> Run:
    """Read a run directory; ``SystemExit`` if it holds no records."""
    path = Path(path)
    records = read_records(path)
    if not records:
        raise SystemExit(f"flexcomm-report: {path} has no {RECORDS_FILE} records (not a flexcomm-train run directory?)")
    summary = read_summary(path)
    complete = summary is not None
    if summary is None:
        config = _read_json(path / "config.json") or {}
        summary = {"config": config, **summarize(records, config.get("target_acc"))}
    return Run(path, path.name, records, summary, _read_json(path / NETWORK_FILE), complete)


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.exists() else None


def write_report(run_dirs: Sequence[Path], out_dir: Path | None = None) -> list[Path]:
    """Write every figure that has data, and the table; return the files written."""
    runs = [load_run(Path(d)) for d in run_dirs]
    out = Path(out_dir) if out_dir is not None else runs[0].path
    out.mkdir(parents=True, exist_ok=True)
    written = [
        plot_accuracy(runs, out / "accuracy.png"),
        plot_step_time(runs, out / "step_time.png"),
        plot_gain(runs, out / "gain.png"),
        plot_leaders(runs, out / "leaders.png"),
        write_table(runs, out / "summary.md"),
    ]
    return [p for p in written if p is not None]


# -- figures ------------------------------------------------------------------------------
CLOCK_LABEL = "time (s, evaluation excluded)"


def _clock(record: dict[str, Any]) -> float:
    """When ``record``'s step ended on the clock of the link's schedule (``wall`` in runs older than ``train_wall``)."""
    return record.get("train_wall", record["wall"])


def plot_accuracy(runs: list[Run], path: Path) -> Path | None:
    evaluated = [(run, [r for r in run.records if r.get("accuracy") is not None]) for run in runs]
    evaluated = [(run, evals) for run, evals in evaluated if evals]
    if not evaluated:
        return None
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    by_time, by_step = fig.subplots(1, 2, sharey=True)
    for run, evals in evaluated:
        acc = [r["accuracy"] for r in evals]
        by_time.plot([_clock(r) for r in evals], acc, marker="o", markersize=3, label=run.name)
        by_step.plot([r["step"] + 1 for r in evals], acc, marker="o", markersize=3, label=run.name)
    by_time.set(xlabel=CLOCK_LABEL, ylabel="test accuracy", title="accuracy vs time")
    by_step.set(xlabel="step", title="accuracy vs step")
    for ax in (by_time, by_step):
        ax.grid(alpha=0.3)
    by_step.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def _time_split(records: list[dict[str, Any]]) -> dict[str, float]:
    """Mean seconds per step spent computing, compressing, waiting for the network, updating."""
    n = len(records)
    compress = sum(r.get("t_compress") or 0.0 for r in records) / n
    wait = sum(r.get("t_wait") or 0.0 for r in records) / n
    busy = (max(0.0, r["t_compute"] - (r.get("t_wait") or 0.0) - (r.get("t_compress") or 0.0)) for r in records)
    compute = sum(busy) / n
    return {
        "compute": compute,
        "compression": compress,
        "communication wait": wait,
        "optimizer + data": sum(r["t_step"] - r["t_compute"] for r in records) / n,
    }


def plot_step_time(runs: list[Run], path: Path) -> Path:
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    bars, over_time = fig.subplots(1, 2, width_ratios=[1, 1.4])
    splits = [_time_split(run.records) for run in runs]
    names = [run.name for run in runs]
    bottoms = [0.0] * len(runs)
    for part in splits[0]:
        heights = [s[part] * 1e3 for s in splits]
        bars.bar(names, heights, bottom=bottoms, label=part)
        bottoms = [b + h for b, h in zip(bottoms, heights)]
    bars.set(ylabel="ms per step (mean)", title="compute vs communication")
    bars.tick_params(axis="x", labelrotation=20, labelsize="small")
    bars.legend(fontsize="small")
    for run in runs:
        walls, step_ms = [_clock(r) for r in run.records], [r["t_step"] * 1e3 for r in run.records]
        over_time.plot(walls, step_ms, lw=0.8, label=run.name)
    _mark_rate_changes(over_time, runs)
    over_time.set(xlabel=CLOCK_LABEL, ylabel="step time (ms)", title="step time over the run", yscale="log")
    over_time.grid(alpha=0.3)
    over_time.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def _mark_rate_changes(ax: Any, runs: list[Run]) -> None:
    """Dotted lines where the first emulated run's network changed rate (its schedule started with training)."""
    network = next((run.network for run in runs if run.network), None)
    if network is None:
        return
    for change in network["changes"]:
        ax.axvline(change["time_s"], color="grey", linestyle=":", lw=1)
        ax.annotate(
            f"{change['rate_bps'] / 1e6:g} Mbit/s", (change["time_s"], 0.02), xycoords=("data", "axes fraction"),
            rotation=90, va="bottom", ha="right", fontsize="x-small", color="grey",
        )


#: Per-step statistics of what an exchange delivered, one panel each in ``gain.png``: (record key, axis, title).
STATISTICS = (("gain", "compression gain ||C(a)|| / ||a||", "compression gain over training"),
              ("quality", "cos(update, mean gradient) on the sample", "measured quality (flex's low-rank exchanges)"))


def plot_gain(runs: list[Run], path: Path) -> Path | None:
    """One panel per statistic that some run records (trailing mean), every such run on it."""
    panels = [(key, axis, title, [run for run in runs if any(r.get(key) is not None for r in run.records)])
              for key, axis, title in STATISTICS]
    panels = [panel for panel in panels if panel[3]]
    if not panels:
        return None
    fig = Figure(figsize=(7 * len(panels), 4.2), layout="constrained")
    for ax, (key, axis, title, recorded) in zip(fig.subplots(1, len(panels), squeeze=False)[0], panels):
        for run in recorded:
            steps, values = zip(*[(r["step"], r[key]) for r in run.records if r.get(key) is not None])
            ax.plot(steps, trailing_mean(list(values)), label=run.name)
        ax.set(xlabel="step", ylabel=axis, title=title, ylim=(0, 1.05))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    fig.savefig(path, dpi=110)
    return path


def trailing_mean(values: list[float], window: int | None = None) -> list[float]:
    """Trailing mean over ``window`` values (default ~2% of the run): per-step gains are noisy."""
    window = window or max(1, len(values) // 50)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_leaders(runs: list[Run], path: Path) -> Path | None:
    led = [run for run in runs if sum(run.summary.get("leader_counts") or []) > 0]
    if not led:
        return None
    fig = Figure(figsize=(7, 4.2), layout="constrained")
    draw_leader_shares(fig.subplots(), [(run.name, run.summary["leader_counts"]) for run in led])
    fig.savefig(path, dpi=110)
    return path


def draw_leader_shares(ax: Any, labelled_counts: Sequence[tuple[str, Sequence[int]]]) -> None:
    """Grouped bars: per rank, the share of steps it was the AR-Topk index source, one bar per run (Fig. 4)."""
    width = 0.8 / len(labelled_counts)
    for i, (label, counts) in enumerate(labelled_counts):
        total = sum(counts) or 1
        ax.bar([r + i * width for r in range(len(counts))], [c / total for c in counts], width, label=label)
    ranks = max(len(counts) for _, counts in labelled_counts)
    ax.set_xticks([r + 0.4 - width / 2 for r in range(ranks)], [str(r) for r in range(ranks)])
    ax.set(xlabel="rank", ylabel="share of steps as index source", title="index-source (leader) share per rank")
    ax.legend(fontsize="small")


# -- table ------------------------------------------------------------------------------
def write_table(runs: list[Run], path: Path) -> Path:
    header = ["run", "model", "compressor", "density (sent / total)", "network", "steps", "mean step time (s)",
              "time to target (s)", "final accuracy", "bytes sent (rank 0)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for run in runs:
        s, c = run.summary, run.config
        name = run.name if run.complete else f"{run.name} (incomplete)"
        target = "-" if s.get("target_acc") is None else _fmt(s.get("time_to_target"), ".1f", "not reached")
        row = [
            name,
            f"{c.get('model', '?')} x{c.get('width', '?')}",
            c.get("compressor", "?"),
            _fmt(s.get("mean_density"), ".3g"),
            c.get("net", "?"),
            str(s["steps"]),
            _fmt(s.get("mean_step_time"), ".3f"),
            target,
            _fmt(s.get("final_accuracy"), ".4f"),
            _bytes(s.get("total_bytes")),
        ]
        lines.append("| " + " | ".join(row) + " |")
    path.write_text("\n".join(lines) + "\n")
    return path


def _fmt(value: float | None, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value, unit = float(n), "B"
    for bigger in ("kB", "MB", "GB"):
        if value < 1000:
            break
        value, unit = value / 1000, bigger
    return f"{value:.0f} B" if unit == "B" else f"{value:.1f} {unit}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="flexcomm-report", description="Plots and a summary table of flexcomm-train runs."
    )
    parser.add_argument("dirs", nargs="+", type=Path, metavar="DIR", help="run directories")
    parser.add_argument("--out", type=Path, help="where to write (default: the first DIR)")
    args = parser.parse_args(argv)
    for d in args.dirs:
        if not d.is_dir():
            parser.error(f"{d} is not a directory")
    for path in write_report(args.dirs, args.out):
        print(path)


if __name__ == "__main__":
    main()
