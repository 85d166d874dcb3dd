"""Elastic resume end to end: a run that loses half its ranks mid-way, against an uninterrupted one.

    python benchmarks/elastic_resize.py [--seeds 1,2,3] [--steps 400] [--from-ranks 4] [--to-ranks 2]

Per seed, two ``flexcomm-train`` runs on loopback (MLP x0.5, AR-Topk STAR at density 0.01,
so every rank carries an error-feedback residual; Fashion-MNIST, full 10k test set every
50 steps): ``uninterrupted`` trains ``--steps`` on ``--from-ranks`` ranks; ``resized``
trains half the steps on ``--from-ranks`` ranks, checkpoints, and resumes with
``--to-ranks`` ranks (``--resume --nproc``) to the end, under the app's residual policy
(``fold``: see ``docs/elastic.md``).  Reported: final accuracy (mean of the last 3
evaluations) of both, and that the resized run's records hold every step once.

Writes ``results/elastic_resize.csv`` and ``results/elastic_resize.png``.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

from common import RESULTS, figure, save, write_csv
from runs import TRAIN

from flexcomm.train.records import FINAL_EVALS, read_records


def train(args: list[str], log: Path) -> None:
    with log.open("w") as out:
        subprocess.run([TRAIN, *args], check=True, stdout=out, stderr=subprocess.STDOUT)


def final_accuracy(run_dir: Path) -> tuple[float, int, int]:
    """(mean of the last evaluations, records, distinct steps)."""
    records = read_records(run_dir)
    evals = [r["accuracy"] for r in records if r.get("accuracy") is not None]
    return statistics.fmean(evals[-FINAL_EVALS:]), len(records), len({r["step"] for r in records})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--from-ranks", type=int, default=4)
    ap.add_argument("--to-ranks", type=int, default=2)
    args = ap.parse_args()
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
    except ValueError:
        ap.error(f"--seeds must be comma-separated integers, got {args.seeds!r}")
    half = args.steps // 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in seeds:
            common = ["--model", "mlp", "--width", "0.5", "--net", "none", "--test-subset", "10000", "--eval-every", "50",
                      "--seed", str(seed), "--compressor", "artopk-star", "--density", "0.01", "--no-report"]
            full, resized = Path(tmp) / f"full{seed}", Path(tmp) / f"resized{seed}"
            print(f"[elastic] seed {seed}: uninterrupted, {args.from_ranks} ranks x {args.steps} steps", flush=True)
            train([*common, "--nproc", str(args.from_ranks), "--steps", str(args.steps), "--out", str(full)], Path(tmp) / "full.log")
            print(f"[elastic] seed {seed}: {args.from_ranks} ranks to step {half}, then {args.to_ranks} ranks", flush=True)
            train([*common, "--nproc", str(args.from_ranks), "--steps", str(half), "--checkpoint-every", str(half),
                   "--out", str(resized)], Path(tmp) / "first.log")
            train([*common, "--nproc", str(args.to_ranks), "--steps", str(args.steps), "--checkpoint-every", str(half),
                   "--resume", "--out", str(resized)], Path(tmp) / "second.log")
            for name, run_dir in (("uninterrupted", full), ("resized", resized)):
                accuracy, records, distinct = final_accuracy(run_dir)
                rows.append({"seed": seed, "run": name, "final_accuracy": accuracy, "records": records,
                             "distinct_steps": distinct})
            shutil.rmtree(full)
            shutil.rmtree(resized)
    write_csv(RESULTS / "elastic_resize.csv", rows, float_format=".6g")
    for name in ("uninterrupted", "resized"):
        values = [r["final_accuracy"] for r in rows if r["run"] == name]
        print(f"{name}: final accuracy {statistics.fmean(values):.4f} (min {min(values):.4f}, max {max(values):.4f})")
    _plot(rows, seeds)


def _plot(rows: list[dict], seeds: list[int]) -> None:
    fig, axes = figure(1, 1, figsize=(6, 4))
    ax = axes[0][0]
    for i, name in enumerate(("uninterrupted", "resized")):
        values = [next(r["final_accuracy"] for r in rows if r["run"] == name and r["seed"] == s) for s in seeds]
        ax.bar(i, statistics.fmean(values), color="tab:gray" if i == 0 else "tab:blue", alpha=0.6)
        ax.scatter([i] * len(values), values, color="black", s=12, zorder=3)
    ax.set_xticks([0, 1], ["uninterrupted", "resized mid-run"])
    ax.set_ylabel(f"final accuracy (mean of last {FINAL_EVALS} evals)")
    ax.set_ylim(bottom=min(r["final_accuracy"] for r in rows) - 0.03)
    save(fig, RESULTS / "elastic_resize.png")


if __name__ == "__main__":
    main()
