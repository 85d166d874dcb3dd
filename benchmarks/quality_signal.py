"""Which measured quality predicts the steps a compressor costs: own energy sent, or agreement with the mean gradient?

    python benchmarks/quality_signal.py [--seeds 1,2,3,4,5] [--methods dense,agtopk0.1,...] [--steps 300] [--quick]

``flex`` and ``density="auto"`` charge an exchange for the steps it costs by the energy
fraction of each rank's own error-corrected gradient it sends (``gain^2``,
:mod:`flexcomm.control.quality`, :mod:`flexcomm.control.density`).  That ranks top-k
densities among themselves, but can it rank a low-rank exchange against top-k?  This
benchmark trains the same model with error feedback under each method and records, per
step, two candidate signals:

``own_energy``   ``sum_i ||sent_i||^2 / sum_i ||a_i||^2``: what the controllers use today;
``cosine``       ``cos(update, mean_i g_i)``: how well the applied update points along the
                 workers' mean raw gradient (a quantity the ranks could estimate online on a
                 shared sample of coordinates, from values they already allreduce).

and the steps each method takes to 0.95x dense's best accuracy of the same seed (full
test set every ``--eval-every`` steps), and its final accuracy (mean of the last 3
evaluations).  A useful signal orders the methods as their steps do.

It is a simulation in one process: ``--workers`` workers, each with its own shard of the
10,000 training images, its own minibatches and its own residual; every step their
gradients are exchanged exactly as flexcomm's exchanges compute them (AG-Topk: the mean of
each worker's own top-k of ``a_i``; ``lowrank``: ``P (sum_i Q_i)^T / N`` with each worker
keeping ``M_i - P Q_i^T``, by :mod:`flexcomm.compress.lowrank`'s functions; dense: the mean),
then one SGD step (momentum 0.9, lr 0.05, batch 32 per worker: ``flexcomm-train``'s
defaults).  No network and no timing: it measures steps, not seconds.

Writes ``quality_signal.csv`` (one row per method and seed), ``quality_signal.json``
(the command and the per-method summary) and ``quality_signal.png`` under ``--out-dir``.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from typing import Any

import torch
from tqdm import tqdm

from common import argument_parser, command_line, figure, numbers, save, write_csv
from flexcomm.compress.lowrank import LowRankQueries, compressible, orthonormalize_
from flexcomm.train.datasets import load_idx_dataset
from flexcomm.train.models import build_model

TRAIN_IMAGES = 10_000
BATCH = 32
LR = 0.05
MOMENTUM = 0.9
TARGET_FRACTION = 0.95


@dataclass(frozen=True)
class Data:
    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor


def load_data() -> Data:
    """Fashion-MNIST: the first 10,000 training images, the full test set, normalised by the training mean and std."""
    train_x, train_y = load_idx_dataset(train=True)
    test_x, test_y = load_idx_dataset(train=False)
    x = torch.tensor(train_x[:TRAIN_IMAGES], dtype=torch.float32).div(255)
    mean, std = x.mean(), x.std()
    test = torch.tensor(test_x, dtype=torch.float32).div(255)
    return Data(x.sub(mean).div(std).unsqueeze(1), torch.tensor(train_y[:TRAIN_IMAGES]),
                test.sub(mean).div(std).unsqueeze(1), torch.tensor(test_y))


def exchange(method: str, params: list[torch.nn.Parameter], accumulated: list[list[torch.Tensor]],
             queries: LowRankQueries) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """The update per parameter and what each worker sent (its residual is ``a_i - sent_i``)."""
    workers = len(accumulated)
    updates, sent = [], [[] for _ in range(workers)]
    for j, p in enumerate(params):
        a = [accumulated[w][j] for w in range(workers)]
        if method == "dense":
            parts = a
        elif method.startswith("agtopk"):
            parts = [_own_topk(x, float(method[len("agtopk"):])) for x in a]
        elif method.startswith("lowrank"):
            parts = _lowrank(a, j, p.shape, int(method[len("lowrank"):]), queries)
        else:
            raise ValueError(f"unknown method {method!r}")
        updates.append(torch.stack(parts).mean(0))
        for w in range(workers):
            sent[w].append(parts[w])
    return updates, sent


def _own_topk(a: torch.Tensor, density: float) -> torch.Tensor:
    flat = a.reshape(-1)
    k = max(1, math.ceil(density * flat.numel()))
    out = torch.zeros_like(flat)
    idx = flat.abs().topk(k).indices
    out[idx] = flat[idx]
    return out.view_as(a)


def _lowrank(a: list[torch.Tensor], j: int, shape: torch.Size, rank: int, queries: LowRankQueries) -> list[torch.Tensor]:
    if not compressible(tuple(shape), rank):
        return a
    q = queries.bucket(j, [(f"p{j}", 0)], [tuple(shape)], torch.device("cpu"), named=True).queries[0]
    ms = [x.reshape(shape[0], -1) for x in a]
    p = orthonormalize_(sum(m @ q for m in ms))
    own = [m.t() @ p for m in ms]
    q.copy_(sum(own))
    return [(p @ o.t()).view(shape) for o in own]


def run(method: str, seed: int, data: Data, workers: int, steps: int, eval_every: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = build_model("mlp", width=0.5, num_classes=10, in_channels=1, image_size=28)
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)
    residuals = [[torch.zeros_like(p) for p in params] for _ in range(workers)]
    queries = LowRankQueries(int(method[len("lowrank"):]), seed=seed) if method.startswith("lowrank") else LowRankQueries()
    shard = TRAIN_IMAGES // workers
    order = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(shard, generator=order) + shard * w for w in range(workers)]
    own_energy, cosine, evals = [], [], []
    for step in range(steps):
        grads = []
        for w in range(workers):
            start = (step * BATCH) % (shard - BATCH)
            batch = perms[w][start : start + BATCH]
            model.zero_grad()
            torch.nn.functional.cross_entropy(model(data.train_x[batch]), data.train_y[batch]).backward()
            grads.append([p.grad.detach().clone() for p in params])
        accumulated = [[g + e for g, e in zip(grads[w], residuals[w])] for w in range(workers)]
        updates, sent = exchange(method, params, accumulated, queries)
        for w in range(workers):
            residuals[w] = [a - s for a, s in zip(accumulated[w], sent[w])]
        own_energy.append(sum(float(s.square().sum()) for w in range(workers) for s in sent[w])
                          / sum(float(a.square().sum()) for w in range(workers) for a in accumulated[w]))
        mean_grad = torch.cat([torch.stack([grads[w][j] for w in range(workers)]).mean(0).reshape(-1) for j in range(len(params))])
        cosine.append(float(torch.nn.functional.cosine_similarity(torch.cat([u.reshape(-1) for u in updates]), mean_grad, dim=0)))
        for p, u in zip(params, updates):
            p.grad = u
        optimizer.step()
        if (step + 1) % eval_every == 0:
            with torch.no_grad():
                evals.append((step + 1, float((model(data.test_x).argmax(1) == data.test_y).float().mean())))
    return {"own_energy": statistics.fmean(own_energy), "cosine": statistics.fmean(cosine), "evals": evals}


def steps_to(evals: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, acc in evals if acc >= target), None)


def main() -> None:
    parser = argument_parser(__doc__, quick="2 seeds, 60 steps (a smoke run)", seeds="1,2,3,4,5",
                             methods="dense,agtopk0.1,agtopk0.03,agtopk0.01,lowrank4,lowrank1")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    seeds, methods = numbers(args.seeds, int), args.methods.split(",")
    steps = 60 if args.quick else args.steps
    if args.quick:
        seeds = seeds[:2]
    if "dense" not in methods:
        parser.error("--methods must include dense (the target is 0.95x dense's best)")
    torch.set_num_threads(2)
    data = load_data()
    rows = []
    with tqdm(total=len(seeds) * len(methods), desc="runs") as bar:
        for seed in seeds:
            runs = {}
            for method in methods:
                runs[method] = run(method, seed, data, args.workers, steps, args.eval_every)
                bar.update()
            target = TARGET_FRACTION * max(acc for _, acc in runs["dense"]["evals"])
            dense_steps = steps_to(runs["dense"]["evals"], target)
            for method, r in runs.items():
                reached = steps_to(r["evals"], target)
                rows.append({"seed": seed, "method": method, "steps_to_target": reached,
                             "steps_vs_dense": reached / dense_steps if reached and dense_steps else None,
                             "final_accuracy": statistics.fmean(acc for _, acc in r["evals"][-3:]),
                             "own_energy": r["own_energy"], "cosine": r["cosine"], "target": target})
    suffix = "_quick" if args.quick else ""
    out = args.out_dir
    write_csv(out / f"quality_signal{suffix}.csv", rows, float_format=".4g")
    summary = {m: _summary([r for r in rows if r["method"] == m]) for m in methods}
    (out / f"quality_signal{suffix}.json").write_text(json.dumps({"command": command_line(), "summary": summary}, indent=2) + "\n")
    _plot(rows, methods, out / f"quality_signal{suffix}.png")
    for method, s in summary.items():
        print(f"{method:12s} steps vs dense {s['steps_vs_dense_median']}  reached {s['reached']}/{s['seeds']}  "
              f"final {s['final_accuracy_mean']:.3f}  own energy {s['own_energy_mean']:.3f}  cosine {s['cosine_mean']:.3f}")


def _summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    ratios = [r["steps_vs_dense"] for r in rows if r["steps_vs_dense"] is not None]
    return {"seeds": len(rows), "reached": len(ratios),
            "steps_vs_dense_median": round(statistics.median(ratios), 3) if ratios else None,
            "final_accuracy_mean": statistics.fmean(r["final_accuracy"] for r in rows),
            "own_energy_mean": statistics.fmean(r["own_energy"] for r in rows),
            "cosine_mean": statistics.fmean(r["cosine"] for r in rows)}


def _plot(rows: list[dict[str, Any]], methods: list[str], path: Any) -> None:
    fig, axes = figure(1, 2, figsize=(10, 4), sharey=True)
    cap = max((r["steps_vs_dense"] for r in rows if r["steps_vs_dense"]), default=1.0) * 1.15
    for ax, signal, label in ((axes[0, 0], "own_energy", "own energy fraction sent (today's signal)"),
                              (axes[0, 1], "cosine", "cos(update, mean raw gradient)")):
        for method in methods:
            mine = [r for r in rows if r["method"] == method]
            ax.scatter([r[signal] for r in mine], [r["steps_vs_dense"] or cap for r in mine], label=method, alpha=0.8)
        ax.axhline(cap, color="grey", lw=0.5, ls=":")
        ax.set_xlabel(f"{label}, mean over the run")
    axes[0, 0].set_ylabel("steps to 0.95x dense's best / dense's (top line: never)")
    axes[0, 1].legend(fontsize=8)
    fig.suptitle("Error-feedback MLP on Fashion-MNIST, simulated workers: which signal orders the methods' steps?")
    save(fig, path)


if __name__ == "__main__":
    main()
