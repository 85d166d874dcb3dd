"""End to end: time to accuracy of flexcomm vs dense DDP, PowerSGD and fp16 on a changing network.

    python benchmarks/e2e.py [--budget-min 30] [--target-frac 0.95] [--alt-target-frac 0.9] [--dry-run]

Every run is ``flexcomm-train`` on Fashion-MNIST (first 10,000 training samples, 1,000 test
samples, evaluation every 50 steps, seed 0 unless said, batch 32 per rank) over emulated hosts whose link
follows a bandwidth schedule that starts with training (see ``runs.py``: ResNet-18 and ViT
``1gbit:8s,30mbit:20s,200mbit``, AlexNet ``1gbit:3s,30mbit:8s,200mbit``), for a fixed number
of steps (no early stop), so every run of a model does the same work.  Groups, in priority
order (optional groups are dropped, last first, when the budget would be exceeded):

0. Seeds (``SEEDED_GROUPS``), run seed by seed (or ``--seeds`` one process per seed), seeds 1, 2, 3:
   dense, static densities and flex with ``density=auto`` (``--auto-warmup 20 --auto-every 10``,
   the rule ``goodput``, and the former default ``near-fastest``), in two groups: ResNet-18 x0.125, 2 ranks, 300
   steps, ``1gbit:3s,30mbit:10s,200mbit``, statics flex and AG-Topk at 0.01; and the demo's
   communication-bound MLP x0.5, 2 ranks, 300 steps, ``100mbit:15s,20mbit:30s,100mbit``,
   evaluation every 25 steps, statics flex at 0.01 and 0.1.  Per seed: target = 0.95 x that
   seed's dense best; reported as mean and spread (min-max) over seeds: time to target, final
   accuracy, auto's time to target over the fastest static setting's, auto's final accuracy
   minus dense's (``e2e_seeds.*`` and ``e2e_seeds_mlp.*``: CSV, Markdown, PNG).
1. ResNet-18 x0.125, 2 ranks, 400 steps: dense, fp16, PowerSGD rank 1 and 4, AG-Topk 0.01,
   MSTopk 0.01, AR-Topk STAR 0.1 / 0.01 / 0.001, VAR 0.01, flex 0.01, STAR density=auto.
2. Non-IID: ResNet-18, 4 ranks, Dirichlet(0.1) label skew, 300 steps: VAR vs STAR at 0.01.
3. (optional) ResNet-18, 4 ranks IID, 300 steps: dense, STAR 0.01, flex 0.01.
4. (optional) ViT x0.5, 2 ranks: dense, PowerSGD r1, STAR 0.01, flex 0.01, STAR auto.
5. (optional) AlexNet x0.125, 2 ranks, 500 steps: the same five.

Target accuracy: ``--target-frac`` (0.95) of the best accuracy of the dense run of the same
model, rank count and seed (rounded down to 0.1 pp); the non-IID group uses ResNet-18 2-rank's.
0.95 rather than a looser fraction because dense reaches 0.9x its best already in the first
(1 Gbit/s) phase, where the network does not matter; time to ``--alt-target-frac`` (0.9)
x best is reported alongside.
Time to target is training time (sum of step times up to the first evaluation at or above
the target; evaluation excluded), as in ``summary.json``; the wall time there is in the CSV.

Writes ``results/e2e.csv``, ``e2e.md``, ``e2e_accuracy.png``, ``e2e_phases.png``,
``e2e_leaders.png`` and prints the headline ratios.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

import e2e_seeds  # noqa: E402
import runs  # noqa: E402
from common import write_csv  # noqa: E402
from runs import RESULTS, Run, Spec, fmt, load, mbytes, metrics  # noqa: E402
from flexcomm.train.report import draw_leader_shares  # noqa: E402

FLEXCOMM = ("agtopk", "mstopk", "artopk-star", "artopk-var", "flex")
SEEDS = (1, 2, 3)
@dataclass(frozen=True)
class SeededGroup:
    """Dense, static densities and ``density="auto"`` over several seeds, one model."""

    name: str
    label: str  # the model as the report names it
    stem: str  # result files: results/<stem>.csv, .md, .png
    model: str
    methods: tuple[tuple[str, str | None, str | None], ...]  # (compressor, density, auto rule); dense sets the target
    steps: int
    net: str
    eval_every: int = runs.EVAL_EVERY

    def specs(self, seeds: tuple[int, ...] = SEEDS) -> list[Spec]:
        """Seed by seed, so a cut-short run set still holds whole seeds; the methods' order rotates with
        the seed, so that seeds run side by side (``--seeds``) run different methods at the same time."""
        m = self.methods
        return [Spec(self.model, c, d, seed=seed, steps=self.steps, net=self.net, auto_every=10, auto_warmup=20,
                     eval_every=self.eval_every, auto_rule=rule)
                for seed in seeds for c, d, rule in m[seed % len(m):] + m[:seed % len(m)]]


SEEDED_GROUPS = {
    # Phases sized for the idle machine, one run at a time (~30 ms per step at 1 Gbit): every run
    # reaches the 30 Mbit phase after ~100 steps; compressed runs end in it, dense leaves it.
    "resnet18": SeededGroup("resnet18 2 ranks, seeds", "ResNet-18 x0.125", "e2e_seeds", "resnet18",
                            (("dense", None, None), ("flex", "0.01", None), ("agtopk", "0.01", None),
                             ("flex", "auto", "goodput"), ("flex", "auto", "near-fastest")),
                            300, "1gbit:3s,30mbit:10s,200mbit"),
    # Communication-bound: the demo's MLP (dense ~0.3 s per step at 100 Mbit, ~1.3 s at 20 Mbit,
    # compute ~10 ms), so time to target is decided by what crosses the link.
    "mlp": SeededGroup("mlp 2 ranks, seeds", "MLP x0.5", "e2e_seeds_mlp", "mlp",
                       (("dense", None, None), ("flex", "0.01", None), ("flex", "0.1", None),
                        ("flex", "auto", "goodput"), ("flex", "auto", "near-fastest")),
                       300, "100mbit:15s,20mbit:30s,100mbit", eval_every=25),
}


def resnet_2() -> list[Spec]:
    m = "resnet18"
    return [
        Spec(m, "dense"),
        Spec(m, "fp16"),
        Spec(m, "powersgd", powersgd_rank=1),
        Spec(m, "powersgd", powersgd_rank=4),
        Spec(m, "agtopk", "0.01"),
        Spec(m, "mstopk", "0.01"),
        Spec(m, "artopk-star", "0.1"),
        Spec(m, "artopk-star", "0.01"),
        Spec(m, "artopk-star", "0.001"),
        Spec(m, "artopk-var", "0.01"),
        Spec(m, "flex", "0.01"),
        Spec(m, "artopk-star", "auto"),
    ]


def noniid() -> list[Spec]:
    return [Spec("resnet18", c, "0.01", nproc=4, partition="dirichlet", dirichlet_alpha=0.1)
            for c in ("artopk-var", "artopk-star")]


def resnet_4() -> list[Spec]:
    return [Spec("resnet18", "dense", nproc=4), Spec("resnet18", "artopk-star", "0.01", nproc=4),
            Spec("resnet18", "flex", "0.01", nproc=4)]


def small(model: str) -> list[Spec]:
    return [Spec(model, "dense"), Spec(model, "powersgd", powersgd_rank=1), Spec(model, "artopk-star", "0.01"),
            Spec(model, "flex", "0.01"), Spec(model, "artopk-star", "auto")]


GROUPS: list[tuple[str, Any, bool]] = [  # name, specs, optional
    *((g.name, g.specs, False) for g in SEEDED_GROUPS.values()),
    ("resnet18 2 ranks", resnet_2, False),
    ("resnet18 4 ranks non-IID", noniid, False),
    ("resnet18 4 ranks", resnet_4, True),
    ("vit 2 ranks", lambda: small("vit"), True),
    ("alexnet 2 ranks", lambda: small("alexnet"), True),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-min", type=float, default=30.0,
                    help="wall-clock budget of this script: an optional group that would overrun it is dropped")
    ap.add_argument("--target-frac", type=float, default=0.95, help="target = this fraction of dense's best accuracy")
    ap.add_argument("--alt-target-frac", type=float, default=0.9, help="a second, looser target, reported alongside")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    ap.add_argument("--report-only", action="store_true", help="run nothing; tables and plots from the runs there are")
    ap.add_argument("--seeds", type=lambda text: tuple(int(x) for x in text.split(",")),
                    help="run only a seeded group's runs of these seeds (comma-separated), no report: for "
                         "one process per seed side by side; then --report-only")
    ap.add_argument("--seeded-model", choices=sorted(SEEDED_GROUPS), default="resnet18",
                    help="the seeded group --seeds runs (default: %(default)s)")
    args = ap.parse_args()
    if args.seeds:
        runs.Runner(f"e2e seeds {args.seeds}").run_all(SEEDED_GROUPS[args.seeded_model].specs(args.seeds))
        return

    groups = [(name, make(), optional) for name, make, optional in GROUPS]
    if args.report_only:
        report([(name, specs) for name, specs, _ in groups], [], args.target_frac, args.alt_target_frac)
        return
    if args.dry_run:
        for name, specs, _ in groups:
            print(f"# {name}")
            for s in specs:
                print(("[done] " if runs.done(s) else "") + s.pretty_command())
        return

    runner = runs.Runner("e2e")
    dropped: list[str] = []
    # Optional groups are cut from the end of the list: estimate from the runs so far.
    for name, specs, optional in groups:
        todo = [s for s in specs if not runs.done(s)]
        estimate = len(todo) * runner.mean_run_seconds()
        remaining = args.budget_min * 60 - runner.elapsed()
        if optional and todo and estimate > remaining:
            print(f"[e2e] dropping '{name}': {len(todo)} runs, ~{estimate:.0f} s, only {remaining:.0f} s left")
            dropped.append(name)
            continue
        runner.run_all(specs)
    print(runner.account())
    report([(name, specs) for name, specs, _ in groups if name not in dropped], dropped, args.target_frac,
           args.alt_target_frac)


# ------------------------------------------------------------------------------------------ report
def report(groups: list[tuple[str, list[Spec]]], dropped: list[str], frac: float, alt_frac: float) -> None:
    loaded = {name: [r for r in (load(s) for s in specs) if r is not None] for name, specs in groups}
    # Targets: the dense run of the same model and rank count.
    dense = {(r.spec.model, r.spec.nproc, r.spec.seed): r for rs in loaded.values() for r in rs
             if r.spec.compressor == "dense" and r.spec.partition == "iid"}
    targets = {key: runs.target_from(run, frac) for key, run in dense.items()}
    alt_targets = {key: runs.target_from(run, alt_frac) for key, run in dense.items()}

    def key_of(run: Run) -> tuple[str, int, int]:
        return (run.spec.model, run.spec.nproc if run.spec.partition == "iid" else 2, run.spec.seed)

    def target_of(run: Run) -> float | None:
        return targets.get(key_of(run))

    rows = [metrics(r, target_of(r), alt_targets.get(key_of(r))) for rs in loaded.values() for r in rs]
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_csv(RESULTS / "e2e.csv", rows, float_format=".6g")
    ratios = headline(loaded.get("resnet18 2 ranks", []), target_of)
    write_md(rows, loaded, dropped, frac, alt_frac, targets, ratios)
    seeded_names = {g.name for g in SEEDED_GROUPS.values()}
    single = {name: rs for name, rs in loaded.items() if name not in seeded_names}  # seeds: e2e_seeds*.png
    plot_accuracy(single, target_of)
    plot_phases(single)
    plot_leaders(loaded.get("resnet18 4 ranks non-IID", []))
    seeded_lines = [line for g in SEEDED_GROUPS.values()
                    for line in e2e_seeds.summarize(loaded.get(g.name, []), target_of, g.label, g.stem)]
    for line in ratios + seeded_lines:
        print(line)
    print(f"wrote {RESULTS / 'e2e.csv'}, e2e.md, e2e_accuracy.png, e2e_phases.png, e2e_leaders.png, e2e_seeds.*")


def headline(rs: list[Run], target_of: Any) -> list[str]:
    """The issue's ratios, for ResNet-18 on 2 ranks."""
    if not rs:
        return ["no ResNet-18 2-rank runs"]
    by = {r.spec.method: r for r in rs}
    target = target_of(rs[0])
    ttt = {m: runs.time_to_target(r, target)[0] if target is not None else None for m, r in by.items()}
    flex = {m: t for m, t in ttt.items() if by[m].spec.compressor in FLEXCOMM and t is not None}
    out = [f"ResNet-18 x0.125, 2 ranks; target accuracy {fmt(target, '.3f')} (of dense's best "
           f"{fmt(by['dense'].summary['best_accuracy'], '.3f') if 'dense' in by else '-'})"]
    if not flex:
        return out + ["no flexcomm configuration reached the target"]
    best = min(flex, key=flex.get)
    b, d = by[best], by.get("dense")
    out.append(f"best flexcomm configuration (shortest time to target): {best} ({flex[best]:.1f} s)")
    if d is not None and ttt.get("dense"):
        out.append(f"  time-to-target vs dense DDP: {flex[best]:.1f} / {ttt['dense']:.1f} s = "
                   f"{flex[best] / ttt['dense']:.2f}x (speed-up {ttt['dense'] / flex[best]:.2f}x)")
    for m in ("powersgd-r1", "powersgd-r4"):
        if m in ttt:
            t = ttt[m]
            out.append(f"  time-to-target vs {m}: " + (f"{flex[best]:.1f} / {t:.1f} s = {flex[best] / t:.2f}x "
                       f"(speed-up {t / flex[best]:.2f}x)" if t else f"{m} did not reach the target"))
    if d is not None:
        sb, sd = runs.slowest_phase(b), runs.slowest_phase(d)
        if sb and sd and sb["mean_step_time"] and sd["mean_step_time"]:
            tb, td = sb["mean_step_time"], sd["mean_step_time"]
            out.append(f"  mean step time in the slow phase ({sd['label']}): {tb * 1e3:.0f} ms vs "
                       f"dense {td * 1e3:.0f} ms = {tb / td:.2f}x")
        final = (b.summary["final_accuracy"] - d.summary["final_accuracy"]) * 100
        best_diff = (b.summary["best_accuracy"] - d.summary["best_accuracy"]) * 100
        out.append(f"  final accuracy minus dense's: {final:+.1f} pp (best accuracy: {best_diff:+.1f} pp)")
    return out


def write_md(rows: list[dict[str, Any]], loaded: dict[str, list[Run]], dropped: list[str], frac: float,
             alt_frac: float, targets: dict[tuple[str, int], float | None], ratios: list[str]) -> None:
    phase_cols = sorted({k for row in rows for k in row if k.startswith("step_ms_P")})
    header = ["group", "method", "time to target (s)", f"time to {alt_frac:g}x (s)", "final acc", "best acc",
              "MB sent", "mean step (ms)", *[f"step {c.removeprefix('step_ms_')} (ms)" for c in phase_cols],
              "t_compute (ms)", "t_sync (ms)", "leaders/rank", "other load (cores)"]
    body = []
    for row in rows:
        ttt = fmt(row["time_to_target_s"], ".1f") if row["target_acc"] is not None else "-"
        if row["target_acc"] is not None and row["time_to_target_s"] is None:
            ttt = "not reached"
        alt = fmt(row["time_to_alt_target_s"], ".1f", "not reached" if row["alt_target_acc"] is not None else "-")
        body.append([row["group"], row["method"], ttt, alt, fmt(row["final_acc"], ".3f"), fmt(row["best_acc"], ".3f"),
                     mbytes(row["total_bytes"]), fmt(row["mean_step_ms"], ".0f"),
                     *[fmt(row.get(c), ".0f") for c in phase_cols], fmt(row["mean_t_compute_ms"], ".0f"),
                     fmt(row["mean_t_sync_ms"], ".1f"), row["leader_counts"] or "-",
                     fmt(row["foreign_cores"], ".2f")])
    schedules = sorted({(r.spec.model, r.spec.schedule) for rs in loaded.values() for r in rs})
    text = ["# End-to-end: time to accuracy on a changing network", "",
            "Fashion-MNIST (10,000 train / 1,000 test samples), batch 32 per rank, SGD lr 0.05 momentum 0.9, seed 0, "
            "fixed step budget, evaluation every 50 steps. Emulated hosts (veth + tbf), bandwidth schedule "
            "(starts with training): " + "; ".join(f"{m}: `{s}`" for m, s in schedules) + ".", "",
            f"Target accuracy = {frac:g} x the dense run's best accuracy (same model and rank count; the non-IID group "
            "uses ResNet-18 2-rank's): " + ", ".join(f"{m} {n} ranks seed {seed}: {fmt(t, '.3f')}" for (m, n, seed), t in targets.items())
            + f" (looser target: {alt_frac:g} x best, second column). Time to target = training time (sum of "
            "step times, evaluation excluded) to the first evaluation at or above it. Step time per phase: steps "
            "placed by their midpoint on the run's wall clock and the applied "
            "rate changes in `network.json` (P1 1 Gbit/s, P2 30 Mbit/s = the slow phase, P3 200 Mbit/s). "
            "t_compute = forward + backward (includes the part of communication that backward waits for); "
            "t_sync = summed exchange times (overlapping backward). MB sent = rank 0's payload over the run. "
            "leaders/rank = how often each rank was AR-Topk's index source."
            " Other load = cores busy with other processes on this shared 2-core machine during the run "
            "(/proc/stat busy time minus the run's own CPU time; '-' = not measured): step times are only "
            "comparable between runs with similar load. The source tree is shared with other sessions: the CSV's "
            "`finished_utc` and `library_sha1` (hash of src/flexcomm at run start, where recorded) say which "
            "library version each run used.", "",
            runs.md_table(header, body)]
    if dropped:
        text.append("Dropped for the wall-clock budget: " + ", ".join(dropped) + ".\n")
    missing = [r.spec for rs in loaded.values() for r in rs]
    missing = [s for _, make, _ in GROUPS for s in make() if s not in missing and s.model in
               {r.spec.model for rs in loaded.values() for r in rs}]
    if missing:
        text.append("Not in the table (failed; the run directory keeps `train.log` and `error-rank*.json`): "
                    + ", ".join(f"{s.group} {s.method} (`{s.dir.name}`)" for s in missing) + ".\n")
    text += ["## Headline (ResNet-18, 2 ranks)", "", *[f"    {line}" for line in ratios], ""]
    (RESULTS / "e2e.md").write_text("\n".join(text))


def _color(method: str) -> dict[str, Any]:
    palette = {"dense": ("black", "-"), "fp16": ("dimgray", "--"), "powersgd-r1": ("tab:brown", "--"),
               "powersgd-r4": ("tab:pink", "--")}
    if method in palette:
        c, ls = palette[method]
        return {"color": c, "linestyle": ls}
    return {}


def plot_accuracy(loaded: dict[str, list[Run]], target_of: Any) -> None:
    names = [n for n, rs in loaded.items() if rs]
    fig = Figure(figsize=(6.5 * min(len(names), 3), 4.6 * ((len(names) + 2) // 3)), layout="constrained")
    axes = fig.subplots((len(names) + 2) // 3, min(len(names), 3), squeeze=False).ravel()
    for ax, name in zip(axes, names):
        rs = loaded[name]
        runs.shade_phases(ax, max(rs, key=lambda r: runs.schedule_time(r.records[-1])))
        for r in rs:
            ev = r.evals
            ax.plot([runs.schedule_time(e) for e in ev], [e["accuracy"] for e in ev], marker="o", ms=2.5, lw=1.2,
                    label=r.spec.method, **_color(r.spec.method))
        target = target_of(rs[0])
        if target is not None:
            ax.axhline(target, color="tab:red", lw=0.8, ls=":", label=f"target {target:.3f}")
        runs.fit_x(ax, rs)
        ax.set(title=rs[0].spec.group, xlabel="wall time (s; shading: network phase, darker = slower)",
               ylabel="test accuracy", ylim=(max(0.0, min(e["accuracy"] for r in rs for e in r.evals) - 0.02), None))
        ax.grid(alpha=0.3)
        ax.legend(fontsize="x-small", ncol=2)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    fig.savefig(RESULTS / "e2e_accuracy.png", dpi=100)


def plot_phases(loaded: dict[str, list[Run]]) -> None:
    names = [n for n, rs in loaded.items() if rs]
    fig = Figure(figsize=(15, 3.6 * len(names)), layout="constrained")
    axes = fig.subplots(len(names), 2, squeeze=False, width_ratios=[1.6, 1])
    for (ax, ax2), name in zip(axes, names):
        rs = loaded[name]
        per = [runs.phase_step_times(r) for r in rs]
        n_phases = max(len(p) for p in per)
        width = 0.8 / max(1, n_phases)
        for i in range(n_phases):
            label = next(p[i]["label"] for p in per if len(p) > i)
            heights = [(p[i]["mean_step_time"] or 0) * 1e3 if len(p) > i else 0 for p in per]
            ax.bar([x + i * width for x in range(len(rs))], heights, width, label=label)
        ax.set_xticks([x + 0.4 - width / 2 for x in range(len(rs))], [r.spec.method for r in rs], rotation=25,
                      ha="right", fontsize="small")
        ax.set(ylabel="mean step time (ms)", title=f"{rs[0].spec.group}: step time per network phase", yscale="log")
        ax.grid(alpha=0.3, axis="y")
        ax.legend(fontsize="small")
        # Fig. 1a: compute vs synchronisation time per step.
        comp = [r.summary["mean_t_compute"] * 1e3 for r in rs]
        sync = [(r.summary.get("mean_t_sync") or 0) * 1e3 for r in rs]
        xs = range(len(rs))
        ax2.bar([x - 0.2 for x in xs], comp, 0.4, label="t_compute (fwd+bwd)")
        ax2.bar([x + 0.2 for x in xs], sync, 0.4, label="t_sync (exchanges)")
        ax2.set_xticks(list(xs), [r.spec.method for r in rs], rotation=25, ha="right", fontsize="small")
        ax2.set(ylabel="ms per step (mean over run)", title="compute vs sync")
        ax2.grid(alpha=0.3, axis="y")
        ax2.legend(fontsize="small")
    fig.savefig(RESULTS / "e2e_phases.png", dpi=90)


def plot_leaders(rs: list[Run]) -> None:
    """Paper Fig. 4 style: label skew per rank, index-source share per rank (VAR vs STAR), accuracy."""
    if not rs:
        return
    fig = Figure(figsize=(16, 4.4), layout="constrained")
    hist_ax, lead_ax, acc_ax = fig.subplots(1, 3)
    data = rs[0].data or {}
    hists = data.get("label_histograms") or []
    bottoms = [0] * len(hists)
    for c in range(len(hists[0]) if hists else 0):
        h = [hist[c] for hist in hists]
        hist_ax.bar(range(len(hists)), h, bottom=bottoms, label=str(c))
        bottoms = [b + x for b, x in zip(bottoms, h)]
    hist_ax.set(xlabel="rank", ylabel="training samples", title=f"label histogram per rank ({rs[0].spec.group})")
    hist_ax.set_xticks(range(len(hists)))
    hist_ax.legend(title="class", fontsize="x-small", ncol=2)
    draw_leader_shares(lead_ax, [(f"{r.spec.method} ({' '.join(map(str, r.summary.get('leader_counts') or []))})",
                                  r.summary.get("leader_counts") or []) for r in rs])
    for r in rs:
        ev = r.evals
        acc_ax.plot([runs.schedule_time(e) for e in ev], [e["accuracy"] for e in ev], marker="o", ms=3,
                    label=f"{r.spec.method}: final {r.summary['final_accuracy']:.3f}, {r.summary['train_time']:.0f} s")
    acc_ax.set(xlabel="wall time (s; shading: network phase)", ylabel="test accuracy", title="accuracy (non-IID)")
    runs.shade_phases(acc_ax, max(rs, key=lambda r: runs.schedule_time(r.records[-1])))
    runs.fit_x(acc_ax, rs)
    acc_ax.grid(alpha=0.3)
    acc_ax.legend(fontsize="small")
    fig.savefig(RESULTS / "e2e_leaders.png", dpi=100)


if __name__ == "__main__":
    main()
