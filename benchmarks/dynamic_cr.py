"""Dynamic compression ratio: AR-Topk (STAR) with density=auto vs each static density and dense.

    python benchmarks/dynamic_cr.py [--budget-min 15] [--target-frac 0.95] [--dry-run]

ResNet-18 x0.125 and ViT x0.5 on 2 emulated hosts, 400 steps, the bandwidth schedule of
``e2e.py`` (``1gbit:8s,30mbit:20s,200mbit``: down to 30 Mbit/s and back up to 200 Mbit/s,
started with training), compressor ``artopk-star`` at density ``auto`` and at the
controller's own candidates 0.1, 0.033, 0.011, 0.004, 0.001, plus dense DDP.  The auto
runs use ``--auto-warmup 40`` (10% of the steps) and ``--auto-every 25`` (a gain
measurement and possible decision every 25 steps; the ramp opens one sparser candidate
per 25 steps, so all candidates are open from step 165).  Runs with settings identical to
``e2e.py``'s (dense, STAR 0.1, STAR 0.001, auto; the same run directories, see
``runs.py``) are reused, not run again.

Target accuracy: ``--target-frac`` (0.95) of the dense run's best accuracy, as in e2e
(time to 0.9x best is in the CSV too).
Writes ``results/dynamic_cr.csv``, ``dynamic_cr.md``, ``dynamic_cr_density.png`` (the
density auto chose over wall time with the network phases shaded; the compression gain
over training of every static density and auto; accuracy over wall time) and prints auto's
final accuracy minus dense's and its time to target vs each static density that also
reaches the target.
"""

from __future__ import annotations

import argparse
from typing import Any

import matplotlib

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402

import runs  # noqa: E402
from common import write_csv  # noqa: E402
from runs import RESULTS, Run, Spec, fmt, load, mbytes, metrics  # noqa: E402
from flexcomm.train.report import trailing_mean  # noqa: E402

STATIC = ("0.1", "0.033", "0.011", "0.004", "0.001")
MODELS = ("resnet18", "vit")


def specs(model: str) -> list[Spec]:
    return [Spec(model, "artopk-star", "auto"), *(Spec(model, "artopk-star", d) for d in STATIC), Spec(model, "dense")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--budget-min", type=float, default=15.0,
                    help="wall-clock budget: a model whose remaining runs would overrun it is reported as dropped")
    ap.add_argument("--target-frac", type=float, default=0.95, help="target = this fraction of dense's best accuracy")
    ap.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = ap.parse_args()
    if args.dry_run:
        for m in MODELS:
            for s in specs(m):
                print(("[reused] " if runs.done(s) else "") + s.pretty_command())
        return
    runner = runs.Runner("dynamic_cr")
    dropped = []
    for m in MODELS:
        todo = [s for s in specs(m) if not runs.done(s)]
        estimate = len(todo) * runner.mean_run_seconds()
        remaining = args.budget_min * 60 - runner.elapsed()
        if m != MODELS[0] and todo and estimate > remaining:
            print(f"[dynamic_cr] dropping {m}: {len(todo)} runs, ~{estimate:.0f} s, only {remaining:.0f} s left")
            dropped.append(m)
            continue
        runner.run_all(specs(m))
    print(runner.account())
    report([m for m in MODELS if m not in dropped], dropped, args.target_frac, runner)


def report(models: list[str], dropped: list[str], frac: float, runner: runs.Runner) -> None:
    loaded = {m: [r for r in (load(s) for s in specs(m)) if r is not None] for m in models}
    rows, lines, targets = [], [], {}
    for m, rs in loaded.items():
        by = {r.spec.density or "dense": r for r in rs}
        target = runs.target_from(by.get("dense"), frac)
        targets[m] = target
        rows += [metrics(r, target, runs.target_from(by.get("dense"), 0.9)) for r in rs]
        lines += headline(m, by, target)
    RESULTS.mkdir(parents=True, exist_ok=True)
    write_csv(RESULTS / "dynamic_cr.csv", rows, float_format=".6g")
    reused = ", ".join(sorted(s.dir.name for m in models for s in specs(m) if s in e2e_specs())) or "none"
    write_md(rows, loaded, dropped, frac, targets, lines, reused)
    plot(loaded, targets)
    for line in lines:
        print(line)
    print(f"shared with e2e.py (trained once): {reused}")
    print(f"wrote {RESULTS / 'dynamic_cr.csv'}, dynamic_cr.md, dynamic_cr_density.png")


def e2e_specs() -> set[Spec]:
    """The runs e2e.py defines: the same settings give the same run directory, trained once."""
    import e2e

    return {s for _, make, _ in e2e.GROUPS for s in make()}


def headline(model: str, by: dict[str, Run], target: float | None) -> list[str]:
    auto, dense = by.get("auto"), by.get("dense")
    out = [f"{model}: target accuracy {fmt(target, '.3f')}"]
    if auto is None:
        return out + ["  no auto run"]
    decisions = auto.summary.get("density_decisions") or []
    chosen = " -> ".join(f"{d['density']:g}@{d['step']}" for d in decisions) or "none"
    out.append(f"  auto's decisions (density@step): {chosen}; mean density {auto.summary['mean_density']:.4f}")
    if dense is not None:
        out.append(f"  auto final accuracy minus dense's: "
                   f"{(auto.summary['final_accuracy'] - dense.summary['final_accuracy']) * 100:+.1f} pp "
                   f"(auto {auto.summary['final_accuracy']:.3f}, dense {dense.summary['final_accuracy']:.3f})")
    if target is None:
        return out
    t_auto = runs.time_to_target(auto, target)[0]
    out.append(f"  auto time to target: {fmt(t_auto, '.1f', 'not reached')} s")
    for key in ("dense", *STATIC):
        r = by.get(key)
        if r is None:
            continue
        t = runs.time_to_target(r, target)[0]
        name = "dense" if key == "dense" else f"static {key}"
        if t is None:
            out.append(f"    vs {name}: did not reach the target")
        elif t_auto is None:
            out.append(f"    vs {name}: {name} reached it in {t:.1f} s, auto did not")
        else:
            out.append(f"    vs {name}: {t_auto:.1f} / {t:.1f} s = {t_auto / t:.2f}x")
    return out


def write_md(rows: list[dict[str, Any]], loaded: dict[str, list[Run]], dropped: list[str], frac: float,
             targets: dict[str, float | None], lines: list[str], reused: str) -> None:
    phase_cols = sorted({k for row in rows for k in row if k.startswith("step_ms_P")})
    header = ["model", "method", "mean density", "time to target (s)", "final acc", "best acc", "MB sent",
              "mean step (ms)", *[f"step {c.removeprefix('step_ms_')} (ms)" for c in phase_cols], "train time (s)",
              "other load (cores)"]
    body = []
    for row in rows:
        ttt = fmt(row["time_to_target_s"], ".1f") if row["target_acc"] is not None else "-"
        if row["target_acc"] is not None and row["time_to_target_s"] is None:
            ttt = "not reached"
        body.append([row["group"], row["method"], fmt(row["mean_density"], ".4f"), ttt, fmt(row["final_acc"], ".3f"),
                     fmt(row["best_acc"], ".3f"), mbytes(row["total_bytes"]), fmt(row["mean_step_ms"], ".0f"),
                     *[fmt(row.get(c), ".0f") for c in phase_cols], fmt(row["train_time_s"], ".1f"),
                     fmt(row["foreign_cores"], ".2f")])
    text = ["# Dynamic compression ratio: density=auto vs static densities", "",
            f"AR-Topk (STAR), 2 emulated hosts, 400 steps, schedule `{runs.NET}` (starts with training), "
            f"Fashion-MNIST 10,000 / 1,000, seed 0. auto: `--auto-warmup 40 --auto-every {runs.AUTO_EVERY}` "
            "(rule asf, candidates 1, 0.1, 0.033, 0.011, 0.004, 0.001). Target = "
            f"{frac:g} x dense's best accuracy: " + ", ".join(f"{m} {fmt(t, '.3f')}" for m, t in targets.items())
            + "; time to target = training time (sum of step times) to the first evaluation at or above it. "
            "P1 1 Gbit/s, P2 30 Mbit/s, P3 200 Mbit/s."
            " Other load = cores busy with other processes on this shared 2-core machine during the run "
            "(/proc/stat busy time minus the run's own CPU time; '-' = not measured): step times are only "
            "comparable between runs with similar load. The source tree is shared with other sessions: the CSV's "
            "`finished_utc` and `library_sha1` (hash of src/flexcomm at run start, where recorded) say which "
            "library version each run used.", "",
            runs.md_table(header, body), f"Shared with e2e.py (identical settings, so one run directory, trained once): {reused}.", ""]
    if dropped:
        text.append("Dropped for the wall-clock budget: " + ", ".join(dropped) + ".\n")
    text += ["## Headline", "", *[f"    {line}" for line in lines], ""]
    (RESULTS / "dynamic_cr.md").write_text("\n".join(text))


def plot(loaded: dict[str, list[Run]], targets: dict[str, float | None]) -> None:
    models = [m for m, rs in loaded.items() if rs]
    fig = Figure(figsize=(17, 4.3 * len(models)), layout="constrained")
    axes = fig.subplots(len(models), 3, squeeze=False)
    colors = {d: f"C{i}" for i, d in enumerate(("auto", *STATIC))} | {"dense": "black"}
    for (dens_ax, gain_ax, acc_ax), m in zip(axes, models):
        by = {r.spec.density or "dense": r for r in loaded[m]}
        auto = by.get("auto")
        if auto is not None:
            runs.shade_phases(dens_ax, auto)
            mids = runs.step_midpoints(auto)
            dens_ax.step(mids, [r["density"] for r in auto.records], where="post", color=colors["auto"],
                         label="auto: density per step")
            decisions = auto.summary.get("density_decisions") or []
            wall_of = {r["step"]: w for r, w in zip(auto.records, mids)}
            dens_ax.plot([wall_of.get(d["step"], None) for d in decisions], [d["density"] for d in decisions], "o",
                         ms=4, color="tab:red", label="controller decisions")
        if auto is not None:
            runs.fit_x(dens_ax, [auto])
        dens_ax.set(yscale="log", ylim=(7e-4, 1.5), xlabel="wall time (s; shading: network phase, darker = slower)",
                    ylabel="density (elements sent / total)", title=f"{m}: density chosen by auto")
        dens_ax.grid(alpha=0.3)
        dens_ax.legend(fontsize="small", loc="lower right")
        for key in ("auto", *STATIC):
            r = by.get(key)
            if r is None:
                continue
            pts = [(x["step"], x["gain"]) for x in r.records if x.get("gain") is not None]
            if pts:
                steps, gains = zip(*pts)
                gain_ax.plot(steps, trailing_mean(list(gains), window=15), color=colors[key], lw=1.8 if key == "auto" else 1.0,
                             label=key)
        gain_ax.set(xlabel="step", ylabel="compression gain ||C(a)|| / ||a|| (smoothed)", ylim=(0, 1.05),
                    title=f"{m}: compression gain over training")
        gain_ax.grid(alpha=0.3)
        gain_ax.legend(fontsize="small", ncol=2)
        runs.shade_phases(acc_ax, by.get("dense") or auto, label=False)
        for key, r in by.items():
            ev = r.evals
            acc_ax.plot([runs.schedule_time(e) for e in ev], [e["accuracy"] for e in ev], marker="o", ms=2.5, color=colors[key],
                        lw=1.8 if key == "auto" else 1.0, label=key)
        if targets.get(m) is not None:
            acc_ax.axhline(targets[m], color="tab:red", lw=0.8, ls=":", label=f"target {targets[m]:.3f}")
        runs.fit_x(acc_ax, by.values())
        acc_ax.set(xlabel="wall time (s; shading: dense run's network phases)", ylabel="test accuracy",
                   title=f"{m}: accuracy")
        acc_ax.grid(alpha=0.3)
        acc_ax.legend(fontsize="x-small", ncol=2)
    fig.savefig(RESULTS / "dynamic_cr_density.png", dpi=95)


if __name__ == "__main__":
    main()
