"""Resident-memory growth of a long multi-rank DDP training loop, per gradient-exchange configuration.

    .venv/bin/python benchmarks/memory_growth.py                          # the default bisection
    .venv/bin/python benchmarks/memory_growth.py --configs flex:auto --steps 6000 --trim
    .venv/bin/python benchmarks/memory_growth.py --configs flex:auto --env MALLOC_ARENA_MAX=2
    .venv/bin/python benchmarks/memory_growth.py --configs flex:0.01,flex:auto --steps 16000 \
        --checkpoint-every 100 --compare-env MALLOC_MMAP_THRESHOLD_=131072   # the launcher's setting vs none

What it measures: for each configuration (``none`` = plain DDP without a hook, else
``COMPRESSOR:DENSITY`` through :func:`flexcomm.register`, DENSITY a number or ``auto``),
N ranks train a small model with gloo on loopback (torch.multiprocessing, no network
emulation) for ``--steps`` steps on synthetic data, draining the hook's records every
step as an app does.  After ``--warmup`` steps each rank samples its resident memory
(VmRSS from /proc/self/status) every ``--sample-every`` steps; with ``--trim`` it first
calls glibc's ``malloc_trim(0)``, which returns free heap pages to the system, so growth
left after trimming is live memory (a leak), growth that trimming removes is free memory
the allocator kept (fragmentation).  ``--env NAME=VALUE`` sets glibc malloc tunables in the
ranks, e.g. ``MALLOC_ARENA_MAX=2`` (fewer per-thread arenas) or ``MALLOC_MMAP_THRESHOLD_=131072``
(large blocks always mmapped, so freeing them returns them to the system); ``--compare-env
NAME=VALUE`` runs every configuration twice, without and with that setting, side by side.  ``--checkpoint-every``
adds what an app's checkpoint does (state dicts of model, optimizer and hook, serialized
in memory).  Each rank also counts live Python objects by type (``gc.get_objects``) at its
first and last sample; the JSON lists the types that grew most.

Reported per configuration and rank: the least-squares slope of RSS against steps in MB
per 1000 steps (and per minute of this run's wall time).  Writes
``benchmarks/results/memory_growth.csv`` (samples), ``.json`` (slopes, object growth,
command) and ``.png`` (RSS since the first sample against steps).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import io
import json
import os
import socket
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from common import proc_status_kib

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_CONFIGS = "none,dense:1,artopk-star:0.01,flex:0.01,flex:auto"
TOP_TYPES = 8


def rss_mb() -> float:
    return proc_status_kib("VmRSS") / 1024


def malloc_trim() -> None:
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def object_counts() -> Counter[str]:
    gc.collect()
    return Counter(type(o).__qualname__ for o in gc.get_objects())


def parse_config(text: str) -> tuple[str, float | str | None]:
    """``none`` -> plain DDP; ``COMPRESSOR:DENSITY`` -> flexcomm (DENSITY a number or ``auto``)."""
    if text == "none":
        return "none", None
    name, _, density = text.partition(":")
    return name, ("auto" if density == "auto" else float(density or 1.0))


def _model(name: str, width: float) -> torch.nn.Module:
    from flexcomm.train.models import build_model

    return build_model(name, 10, 1, 28, width)


def rank_main(rank: int, args: argparse.Namespace, config: str, port: int, out: str) -> None:
    """One rank: train ``args.steps`` steps, sampling RSS; write the samples to ``out``/rank<r>.json."""
    import flexcomm
    from flexcomm.control import DensityController

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(args.nproc))
    dist.init_process_group("gloo", rank=rank, world_size=args.nproc)
    torch.manual_seed(0)
    ddp = DistributedDataParallel(_model(args.model, args.width), bucket_cap_mb=args.bucket_cap_mb)
    compressor, density = parse_config(config)
    state = None
    if compressor != "none":
        controller = None
        if density == "auto":
            controller = DensityController(warmup_steps=args.auto_warmup, measure_every=args.auto_every)
        state = flexcomm.register(ddp, compressor=compressor, density=density, controller=controller)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=0.01, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    xs = torch.randn(8, args.batch_size, 1, 28, 28, generator=gen)
    ys = torch.randint(0, 10, (8, args.batch_size), generator=gen)
    samples: list[dict[str, float]] = []
    first_objects: Counter[str] | None = None
    started = time.monotonic()
    for step in range(1, args.steps + 1):
        loss = F.cross_entropy(ddp(xs[step % 8]), ys[step % 8])
        loss.backward()
        if state is not None:
            state.drain_records()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.checkpoint_every and step % args.checkpoint_every == 0:
            blob = {"model": ddp.module.state_dict(), "optimizer": optimizer.state_dict(),
                    "comm": state.state_dict() if state is not None else {}}
            torch.save(blob, io.BytesIO())
            dist.barrier()
        if step >= args.warmup and (step - args.warmup) % args.sample_every == 0:
            raw = rss_mb()
            if args.trim:
                malloc_trim()
            sample = {"step": step, "t_s": time.monotonic() - started, "rss_mb": raw,
                      "rss_after_trim_mb": rss_mb() if args.trim else raw}
            samples.append(sample)
            if first_objects is None:
                first_objects = object_counts()
            if rank == 0:
                print(f"  [{config}] step {step}/{args.steps}  rank 0 RSS {raw:.1f} MB"
                      + (f" ({sample['rss_after_trim_mb']:.1f} after trim)" if args.trim else ""), flush=True)
    last_objects = object_counts()
    growth = last_objects.copy()
    growth.subtract(first_objects or Counter())
    result = {"rank": rank, "samples": samples, "objects_first": sum((first_objects or Counter()).values()),
              "objects_last": sum(last_objects.values()),
              "object_growth": dict(sorted(((k, v) for k, v in growth.items() if v), key=lambda kv: -abs(kv[1]))[:TOP_TYPES])}
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def slope_per_1000(samples: list[dict[str, float]], key: str, x: str = "step") -> float:
    if len(samples) < 2:
        return float("nan")
    return float(np.polyfit([s[x] for s in samples], [s[key] for s in samples], 1)[0]) * 1000


def run_config(args: argparse.Namespace, config: str) -> list[dict[str, Any]]:
    """Spawn the ranks of one configuration; return each rank's result."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as out:
        mp.spawn(rank_main, args=(args, config, port, out), nprocs=args.nproc, join=True)
        return [json.loads(Path(out, f"rank{r}.json").read_text()) for r in range(args.nproc)]


def run_with(args: argparse.Namespace, config: str, setting: str | None) -> list[dict[str, Any]]:
    """:func:`run_config` with ``NAME=VALUE`` in the ranks' environment (spawned ranks copy it at start)."""
    if setting is None:
        return run_config(args, config)
    name, _, value = setting.partition("=")
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        return run_config(args, config)
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def summarize(config: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    per_rank = {}
    for r in ranks:
        s = r["samples"]
        minutes = (s[-1]["t_s"] - s[0]["t_s"]) / 60 if len(s) > 1 else float("nan")
        steps = s[-1]["step"] - s[0]["step"] if len(s) > 1 else 0
        per_rank[r["rank"]] = {
            "mb_per_1000_steps": slope_per_1000(s, "rss_mb"),
            "mb_per_1000_steps_after_trim": slope_per_1000(s, "rss_after_trim_mb"),
            "mb_per_min": slope_per_1000(s, "rss_mb") * steps / 1000 / minutes if minutes else float("nan"),
            "steps_per_min": steps / minutes if minutes else float("nan"),
            "first_mb": s[0]["rss_mb"], "last_mb": s[-1]["rss_mb"],
            "python_objects": [r["objects_first"], r["objects_last"]], "object_growth": r["object_growth"],
        }
    return {"config": config, "per_rank": per_rank}


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    for i, config in enumerate(dict.fromkeys(r["config"] for r in rows)):
        for rank in sorted({r["rank"] for r in rows if r["config"] == config}):
            mine = [r for r in rows if r["config"] == config and r["rank"] == rank]
            ax.plot([r["step"] for r in mine], [r["rss_mb"] - mine[0]["rss_mb"] for r in mine], color=f"C{i}",
                    alpha=0.8, linestyle="-" if rank == 0 else ":", label=config if rank == 0 else None)
    ax.set(xlabel="step", ylabel="RSS since first sample (MB)", title="resident memory per rank (solid: rank 0)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma-separated (default: {DEFAULT_CONFIGS})")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--warmup", type=int, default=500, help="steps before the first sample")
    parser.add_argument("--sample-every", type=int, default=100)
    parser.add_argument("--model", default="mlp", choices=("mlp", "resnet18", "alexnet", "vit"))
    parser.add_argument("--width", type=float, default=0.125)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--bucket-cap-mb", type=float, default=0.05, help="small: several DDP buckets per step")
    parser.add_argument("--auto-warmup", type=int, default=20)
    parser.add_argument("--auto-every", type=int, default=20)
    parser.add_argument("--checkpoint-every", type=int, default=0, help="0: no checkpoints")
    parser.add_argument("--trim", action="store_true", help="malloc_trim(0) before each sample")
    parser.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                        help="environment of the ranks, e.g. MALLOC_ARENA_MAX=2 (repeatable)")
    parser.add_argument("--compare-env", metavar="NAME=VALUE",
                        help="run every configuration without and with this environment setting")
    parser.add_argument("--out", type=Path, default=RESULTS / "memory_growth", help="output stem (.csv/.json/.png)")
    args = parser.parse_args()
    for setting in args.env:  # glibc reads its MALLOC_* variables when a spawned rank starts
        name, _, value = setting.partition("=")
        os.environ[name] = value
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    variants = [None, args.compare_env] if args.compare_env else [None]
    runs = [(config, variant) for config in configs for variant in variants]
    rows: list[dict[str, Any]] = []
    summaries = []
    for n, (config, variant) in enumerate(runs, 1):
        label = config if variant is None else f"{config} {variant}"
        print(f"memory_growth: run {n}/{len(runs)} {label}: {args.nproc} ranks, {args.steps} steps", flush=True)
        ranks = run_with(args, config, variant)
        rows += [{"config": label, "rank": r["rank"], **s} for r in ranks for s in r["samples"]]
        summaries.append(summarize(label, ranks))
        for rank, g in summaries[-1]["per_rank"].items():
            print(f"  {label} rank {rank}: {g['mb_per_1000_steps']:+.3f} MB/1000 steps"
                  + (f" ({g['mb_per_1000_steps_after_trim']:+.3f} after trim)" if args.trim else "")
                  + f", {g['mb_per_min']:+.3f} MB/min at {g['steps_per_min']:.0f} steps/min; objects grew "
                  f"{g['python_objects'][1] - g['python_objects'][0]:+d}", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with open(args.out.with_suffix(".csv"), "w") as f:
        f.write("config,rank,step,t_s,rss_mb,rss_after_trim_mb\n")
        f.writelines(f"{r['config']},{r['rank']},{r['step']},{r['t_s']:.2f},{r['rss_mb']:.3f},{r['rss_after_trim_mb']:.3f}\n"
                     for r in rows)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"command": " ".join([Path(sys.executable).name, *sys.argv]), "settings": settings,
              "torch": torch.__version__, "configs": summaries}
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    plot(rows, args.out.with_suffix(".png"))
    print(f"memory_growth: wrote {args.out.with_suffix('.csv')}, .json, .png")


if __name__ == "__main__":
    main()
