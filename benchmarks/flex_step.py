"""One training step of a 25M-parameter, multi-bucket model: does ``flex`` match the best exchange?

    python benchmarks/flex_step.py [--links loopback,1gbit,100mbit] [--density 0.01] [--rounds 6]

The model is a stack of ``--layers`` (4) fully connected layers of ``--width`` (2500) units
(4 x 6.25M = 25.0M parameters), batch 32 per rank, DDP with ``bucket_cap_mb=20`` so every
layer is its own bucket.  One step = zero_grad, forward, backward (the hook exchanges the
buckets while backward runs), SGD step.  Side by side in one job per link (2 ranks; two
emulated hosts for a shaped link, :class:`flexcomm.netem.EmulatedCluster`):

* ``plain_ddp``: no hook, DDP's own allreduce;
* ``fp16_hook``: PyTorch's ``fp16_compress_hook`` (what flex's ``dense16`` sends);
* ``agtopk``, ``artopk`` (STAR): flexcomm's compressors at ``--density``;
* ``flex`` at ``--density``: first ``--flex-settle`` untimed steps (probes, agreements,
  exploration), then timed like the others.

Rounds give every method one step in an order rotated from round to round, the ranks
lined up before each step; a step's time is the max over ranks, a method's time the median
of its timed steps.  Printed per link: each method's median step and ``flex / best of the
others`` (goal <= 1.05); flex's per-bucket choices; the prediction error of flex's model
per exchange (median of ``|predicted - measured| / measured`` over every bucket exchange flex's
planner agreed on: blocking local work plus the collectives' own time, predicted when planned).

Writes ``flex_step.csv`` (one row per link and method), ``flex_step_predictions.csv``
(one row per flex bucket exchange) and ``flex_step.png`` to ``--out-dir``.
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from common import (align, argument_parser, figure, finish_worker, init_worker, main_or_worker, max_over_ranks,
                    network, progress, run_job, save, write_csv)

METHODS = ("plain_ddp", "fp16_hook", "agtopk", "artopk", "flex")
COMPRESSOR = {"plain_ddp": None, "fp16_hook": None, "agtopk": "agtopk", "artopk": "artopk-star", "flex": "flex"}
BATCH = 32
BUCKET_CAP_MB = 20  # each 25 MB layer overflows it: one layer per bucket


# ============================================================================ worker side
def mlp(layers: int, width: int) -> nn.Module:
    """``layers`` Linear(width, width) with ReLU between; the same weights on every rank."""
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for i in range(layers):
        blocks.append(nn.Linear(width, width))
        if i + 1 < layers:
            blocks.append(nn.ReLU())
    return nn.Sequential(*blocks)


def build(method: str, cfg: dict[str, Any]) -> tuple[DDP, torch.optim.Optimizer, flexcomm.FlexState | None]:
    model = DDP(mlp(cfg["layers"], cfg["width"]), bucket_cap_mb=BUCKET_CAP_MB, init_sync=False)
    state = None
    if method == "fp16_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif COMPRESSOR[method] is not None:
        state = flexcomm.register(model, compressor=COMPRESSOR[method], density=cfg["density"])
    return model, torch.optim.SGD(model.parameters(), lr=1e-4), state


def timed_step(model: DDP, optimizer: torch.optim.Optimizer, x: torch.Tensor) -> float:
    """This rank's time of one aligned training step."""
    align()
    started = perf_counter()
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()
    return perf_counter() - started


def worker_main(cfg: dict[str, Any]) -> None:
    rank, _ = init_worker()
    gen = torch.Generator().manual_seed(1 + rank)
    inputs = [torch.randn(BATCH, cfg["width"], generator=gen) for _ in range(4)]
    built = {m: build(m, cfg) for m in METHODS}
    for method, (model, opt, _) in built.items():
        settle = cfg["flex_settle"] if method == "flex" else cfg["warmup"]
        for i in range(settle):
            timed_step(model, opt, inputs[i % len(inputs)])
            progress()
    flex_state = built["flex"][2]
    assert flex_state is not None
    flex_state.drain_records()
    local: dict[str, list[float]] = {m: [] for m in METHODS}
    flex_records = []
    for rnd in range(cfg["rounds"]):
        order = METHODS[rnd % len(METHODS):] + METHODS[: rnd % len(METHODS)]
        for method in order:
            model, opt, state = built[method]
            local[method].append(timed_step(model, opt, inputs[rnd % len(inputs)]))
            if method == "flex":
                flex_records += [r.as_dict() for r in state.drain_records()]
            progress()
    flat = max_over_ranks([t for m in METHODS for t in local[m]])
    per = len(flat) // len(METHODS)
    predictions = [list(p) for p in flex_state.planner.prediction_log]
    chooser, world = flex_state.chooser, flex_state.world_size
    model = {b: {"plan": chooser.plan.get(b), **vars(chooser.costs(b, cfg["density"], world))} for b in chooser.order}
    result = {"steps": {m: flat[i * per:(i + 1) * per] for i, m in enumerate(METHODS)}, "flex_records": flex_records,
              "predictions": predictions, "model": model}
    finish_worker(cfg, result)


# ============================================================================ launcher side
def method_rows(link: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    steps = result["steps"]
    medians = {m: statistics.median(ts) for m, ts in steps.items()}
    best_other = min(t for m, t in medians.items() if m != "flex")
    return [{"link": link, "method": m, "median_step_ms": medians[m] * 1e3, "steps": len(steps[m]),
             "min_step_ms": min(steps[m]) * 1e3, "max_step_ms": max(steps[m]) * 1e3,
             "vs_best_other": medians[m] / best_other} for m in METHODS]


def prediction_rows(link: str, predictions: Sequence[Sequence[Any]]) -> list[dict[str, Any]]:
    """Flex's predicted vs agreed measured seconds (blocking work + collectives) of every bucket exchange."""
    return [{"link": link, "exchange": exchange, "predicted_s": predicted, "measured_s": measured,
             "rel_error": abs(predicted - measured) / measured if measured > 0 else float("nan")}
            for exchange, predicted, measured in predictions]


def plot(rows: Sequence[dict[str, Any]], links: Sequence[str], path: Path) -> None:
    fig, axes = figure(1, len(links), figsize=(4.2 * len(links), 4))
    colors = {"plain_ddp": "tab:blue", "fp16_hook": "tab:purple", "agtopk": "tab:orange", "artopk": "tab:green", "flex": "tab:red"}
    for ax, link in zip(axes[0], links):
        mine = [r for r in rows if r["link"] == link]
        ax.bar([r["method"] for r in mine], [r["median_step_ms"] for r in mine],
               color=[colors[r["method"]] for r in mine])
        flex = next(r for r in mine if r["method"] == "flex")
        ax.set(title=f"{link}: flex / best other = {flex['vs_best_other']:.2f}", ylabel="median step (ms)")
        ax.grid(alpha=0.3, axis="y")
    save(fig, path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argument_parser(__doc__, links="loopback,1gbit,100mbit")
    ap.add_argument("--density", type=float, default=0.01)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=2500)
    ap.add_argument("--rounds", type=int, default=6, help="timed steps per method")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps of the static methods")
    ap.add_argument("--flex-settle", type=int, default=60, help="untimed steps of flex before timing")
    args = ap.parse_args(argv)
    links = args.links.split(",")
    cfg = {k: getattr(args, k) for k in ("density", "layers", "width", "rounds", "warmup", "flex_settle")}
    rows: list[dict[str, Any]] = []
    predictions: list[dict[str, Any]] = []
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for done, link in enumerate(links, 1):
        total = args.flex_settle + args.warmup * (len(METHODS) - 1) + args.rounds * len(METHODS)
        with network(None if link == "loopback" else link, 2, "fcs") as cluster:
            result = run_job(__file__, cluster, 2, cfg, total=total, desc=link, timeout=1800)
        rows += method_rows(link, result)
        predictions += prediction_rows(link, result["predictions"])
        report(link, rows, result)
        # Written after every link, so a cut-short run keeps the links it finished.
        write_csv(args.out_dir / "flex_step.csv", rows)
        write_csv(args.out_dir / "flex_step_predictions.csv", predictions)
        plot(rows, links[:done], args.out_dir / "flex_step.png")
    print_errors(predictions)
    print(f"wrote {args.out_dir / 'flex_step.csv'}, flex_step_predictions.csv, flex_step.png")
    return 0


def report(link: str, rows: Sequence[dict[str, Any]], result: dict[str, Any]) -> None:
    mine = [r for r in rows if r["link"] == link]
    print(f"[{link}] " + ", ".join(f"{r['method']} {r['median_step_ms']:.0f} ms" for r in mine))
    flex = next(r for r in mine if r["method"] == "flex")
    print(f"[{link}] flex / best of the others = {flex['vs_best_other']:.3f} (goal <= 1.05)")
    choices = Counter((r["bucket"], r["exchange"]) for r in result["flex_records"])
    print(f"[{link}] flex choices (bucket, exchange): count = {dict(sorted(choices.items()))}")
    for bucket, m in result["model"].items():
        costs = ", ".join(f"{e} {m['block'][e] * 1e3:.0f}+{m['comm'][e] * 1e3:.0f}" for e in m["comm"])
        print(f"[{link}] flex's model, bucket {bucket} (plan {m['plan']}): block+comm ms {costs}; "
              f"backward after it {m['gap'] * 1e3:.0f} ms")


def print_errors(predictions: Sequence[dict[str, Any]]) -> None:
    groups: dict[tuple[str, str], list[float]] = {}
    for p in predictions:
        groups.setdefault((p["link"], p["exchange"]), []).append(p["rel_error"])
    for (link, exchange), errors in sorted(groups.items()):
        print(f"[{link}] {exchange}: median |predicted - measured| / measured = {statistics.median(errors):.2f} "
              f"over {len(errors)} bucket exchanges")


if __name__ == "__main__":
    main_or_worker(main, worker_main)
