"""What the hook itself costs: dense through flexcomm vs plain DDP, and the library's heap over a long run.

    python benchmarks/hook_overhead.py [--rounds 4 --block 10] [--heap-steps 1500] [--net 1gbit --layers 2 --width 580]

Part 1, side by side in one job (2 gloo ranks on loopback or, with ``--net``, on two emulated
hosts; by default the 25M-parameter 4-bucket MLP of ``flex_step.py``, batch 32): one training step with

* ``plain_ddp``: DDP's built-in C++ allreduce, no Python hook;
* ``python_allreduce_hook``: PyTorch's own Python ``default_hooks.allreduce_hook`` (the floor
  of any Python comm hook: the GIL, a Python call and a ``Future.then`` per bucket);
* ``fp16_hook``: PyTorch's ``default_hooks.fp16_compress_hook`` (the bucket allreduced in fp16);
* ``flexcomm_dense``: ``flexcomm.register(compressor="dense")`` (dispatcher thread, step
  protocol, records);
* ``flex_dense``: ``compressor="flex"`` at density 1.0 without the low-rank exchange: flex's
  choice between dense and dense16 per bucket (what a fast link's plan runs);
* ``flex``: ``compressor="flex"`` at density 0.01.

The flex methods run ``--flex-settle`` untimed steps first; the table says which exchanges their
timed steps ran (rank 0's records).

Each round runs ``--block`` consecutive steps of every method, in an order rotated from round to
round; a step's time is the max over ranks, a method's the median of its ``rounds x block`` steps.
Blocks, not single steps: flex measures the period from one of its steps to its next and plans
on it, and a period that spans the other methods' steps measures them (with one step per round,
flex's plan at density 1.0 churned between dense and dense16 on loopback, 84 of 160 buckets
dense16 where the fp16 hook is 1.18x plain DDP).

Part 2 (``--heap-steps 0`` skips it): ``--heap-steps`` steps of a small 6-bucket MLP with ``flex`` + ``density="auto"``
(``flex_interval`` 10), records drained every step as the training app does; Python's
``tracemalloc`` compares the heap a third of the way in with the end and lists the largest
growth by allocation site (Python objects only: torch's C++ allocations are not traced).

Writes ``hook_overhead.csv`` (part 1), ``hook_overhead_heap.txt`` (part 2) and
``hook_overhead.png`` to ``--out-dir`` (``hook_overhead_<net>.*`` with ``--net``).
"""

from __future__ import annotations

import gc
import statistics
import tracemalloc
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from common import (argument_parser, command_line, figure, finish_worker, init_worker, main_or_worker, max_over_ranks,
                    network, progress, run_job, save, write_csv)
from flex_step import BATCH, BUCKET_CAP_MB, mlp, timed_step

METHODS = ("plain_ddp", "python_allreduce_hook", "fp16_hook", "flexcomm_dense", "flex_dense", "flex")
FLEX = ("flex_dense", "flex")
HEAP_TOP = 8


# ============================================================================ worker side
def build(method: str, cfg: dict[str, Any]) -> tuple[DDP, torch.optim.Optimizer, flexcomm.FlexState | None]:
    model = DDP(mlp(cfg["layers"], cfg["width"]), bucket_cap_mb=BUCKET_CAP_MB, init_sync=False)
    state = None
    if method == "python_allreduce_hook":
        model.register_comm_hook(None, default_hooks.allreduce_hook)
    elif method == "fp16_hook":
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif method == "flexcomm_dense":
        state = flexcomm.register(model, compressor="dense")
    elif method == "flex_dense":
        state = flexcomm.register(model, compressor="flex", density=1.0, lowrank=False)
    elif method == "flex":
        state = flexcomm.register(model, compressor="flex", density=0.01)
    return model, torch.optim.SGD(model.parameters(), lr=1e-4), state


def step_times(cfg: dict[str, Any]) -> tuple[dict[str, list[float]], dict[str, dict[str, int]]]:
    """Interleaved timed steps of every method, max over ranks; the bucket exchanges flex's timed steps ran."""
    gen = torch.Generator().manual_seed(1 + torch.distributed.get_rank())
    x = torch.randn(BATCH, cfg["width"], generator=gen)
    built = {m: build(m, cfg) for m in METHODS}
    for method, (model, opt, state) in built.items():
        for _ in range(cfg["flex_settle"] if method in FLEX else cfg["warmup"]):
            timed_step(model, opt, x)
            progress()
        if state is not None:
            state.drain_records()
    local: dict[str, list[float]] = {m: [] for m in METHODS}
    for rnd in range(cfg["rounds"]):
        for method in METHODS[rnd % len(METHODS):] + METHODS[: rnd % len(METHODS)]:
            model, opt, _ = built[method]
            for _ in range(cfg["block"]):
                local[method].append(timed_step(model, opt, x))
                progress()
    flat = max_over_ranks([t for m in METHODS for t in local[m]])
    per = cfg["rounds"] * cfg["block"]
    ran = {m: dict(Counter(r.exchange for r in built[m][2].drain_records())) for m in FLEX}
    return {m: flat[i * per:(i + 1) * per] for i, m in enumerate(METHODS)}, ran


def heap_growth(cfg: dict[str, Any]) -> dict[str, Any]:
    """Python heap growth of flex + auto between a third of ``heap_steps`` and the end."""
    torch.manual_seed(0)
    model = DDP(nn.Sequential(*[nn.Linear(256, 256) for _ in range(6)]), bucket_cap_mb=0.3)
    state = flexcomm.register(model, compressor="flex", density="auto", flex_interval=10)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(16, 256)
    steps = cfg["heap_steps"]
    first = steps // 3
    tracemalloc.start(8)
    snapshots = {}
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()
        state.drain_records()
        if step in (first, steps - 1):
            gc.collect()
            snapshots[step] = tracemalloc.take_snapshot()
        progress()
    tracemalloc.stop()
    diffs = snapshots[steps - 1].compare_to(snapshots[first], "traceback")
    top = [{"kib": d.size_diff / 1024, "count": d.count_diff, "site": d.traceback.format()[-2:]} for d in diffs[:HEAP_TOP]]
    return {"steps": steps - 1 - first, "kib": sum(d.size_diff for d in diffs) / 1024, "top": top}


def worker_main(cfg: dict[str, Any]) -> None:
    init_worker()
    steps, ran = step_times(cfg)
    result = {"steps": steps, "ran": ran, "heap": heap_growth(cfg) if cfg["heap_steps"] else None}
    finish_worker(cfg, result)


# ============================================================================ launcher side
def method_rows(steps: dict[str, list[float]], ran: dict[str, dict[str, int]]) -> list[dict[str, Any]]:
    medians = {m: statistics.median(ts) for m, ts in steps.items()}
    return [{"method": m, "median_step_ms": medians[m] * 1e3, "steps": len(steps[m]),
             "min_step_ms": min(steps[m]) * 1e3, "max_step_ms": max(steps[m]) * 1e3,
             "vs_plain_ddp": medians[m] / medians["plain_ddp"],
             "vs_python_allreduce_hook": medians[m] / medians["python_allreduce_hook"],
             "vs_fp16_hook": medians[m] / medians["fp16_hook"],
             "exchanges": " ".join(f"{e}:{n}" for e, n in sorted(ran.get(m, {}).items()))} for m in METHODS]


def heap_report(heap: dict[str, Any], ranks: int) -> str:
    lines = [command_line(),
             f"rank 0 of {ranks}: Python heap growth over {heap['steps']} steps of flex + density auto: "
             f"{heap['kib']:.1f} KiB ({heap['kib'] * 1024 / heap['steps']:.0f} bytes per step)",
             "largest growth by allocation site:"]
    for t in heap["top"]:
        lines.append(f"  {t['kib']:+8.1f} KiB  {t['count']:+6d} objects  " + " | ".join(s.strip() for s in t["site"]))
    return "\n".join(lines) + "\n"


def plot(rows: Sequence[dict[str, Any]], steps: dict[str, list[float]], title: str, path: Any) -> None:
    fig, axes = figure(1, 1, figsize=(9, 4))
    ax = axes[0][0]
    ax.boxplot([[t * 1e3 for t in steps[m]] for m in METHODS], showfliers=False)
    ax.set_xticks(range(1, len(METHODS) + 1), [f"{r['method']}\n{r['vs_plain_ddp']:.3f}x" for r in rows], fontsize=8)
    ax.set(ylabel="step (ms), max over ranks", title=title)
    ax.grid(alpha=0.3, axis="y")
    save(fig, path)


def main() -> int:
    ap = argument_parser(__doc__)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of every method")
    ap.add_argument("--block", type=int, default=10, help="consecutive timed steps of a method per round")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--flex-settle", type=int, default=40)
    ap.add_argument("--heap-steps", type=int, default=1500)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=2500)
    ap.add_argument("--net", default=None, help="rate of an emulated link between the 2 hosts, e.g. 1gbit "
                                                "(default: loopback; needs root)")
    args = ap.parse_args()
    cfg = {k: getattr(args, k) for k in ("rounds", "block", "warmup", "flex_settle", "heap_steps", "layers", "width")}
    total = (args.warmup * (len(METHODS) - len(FLEX)) + args.flex_settle * len(FLEX)
             + args.rounds * args.block * len(METHODS) + args.heap_steps)
    with network(args.net, 2, "hookov") as cluster:
        result = run_job(__file__, cluster, 2, cfg, total=total, desc="hook overhead", timeout=1800)
    rows = method_rows(result["steps"], result["ran"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = "hook_overhead" + (f"_{args.net}" if args.net else "")
    write_csv(args.out_dir / f"{stem}.csv", rows)
    params = args.layers * args.width * (args.width + 1)
    plot(rows, result["steps"], f"one training step, {params / 1e6:.2f}M params, {args.net or 'loopback'}",
         args.out_dir / f"{stem}.png")
    for r in rows:
        print(f"{r['method']:>22}: {r['median_step_ms']:.1f} ms  x{r['vs_plain_ddp']:.3f} plain DDP  "
              f"x{r['vs_python_allreduce_hook']:.3f} Python allreduce hook  x{r['vs_fp16_hook']:.3f} fp16 hook  "
              f"{r['exchanges']}")
    if result["heap"] is not None:
        heap = heap_report(result["heap"], 2)
        (args.out_dir / f"{stem}_heap.txt").write_text(heap)
        print(heap, end="")
    return 0


if __name__ == "__main__":
    main_or_worker(main, worker_main)
