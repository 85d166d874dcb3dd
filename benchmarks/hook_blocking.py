"""How long backward is held inside the hook: AR-Topk at commit d1e7473 (blocking broadcast) vs now (dispatcher).

    python benchmarks/hook_blocking.py [--steps 20] [--buckets 8] [--numel 1e6] [--world 2]

Runs the same job twice, each in fresh processes on loopback gloo: a DDP model of
``--buckets`` parameters of ``--numel`` float32 each (one bucket per parameter), AR-Topk
(STAR) at density 0.01.  Once with the flexcomm source tree of commit d1e7473 (exported
with ``git archive`` to a temporary directory and put first on ``PYTHONPATH``), once with
this checkout's.  Per step and rank it measures the wall time spent inside
``flexcomm.hook`` calls (time backward could not proceed) and the whole backward.
Reported: medians over steps after two warm-up steps, max over ranks.

Writes ``hook_blocking.csv`` and ``hook_blocking.txt`` under ``--out-dir``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import argument_parser, command_line, median, write_csv

BEFORE = "d1e7473"
WARMUP = 2


def worker(rank: int, world: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    import flexcomm

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=cfg["init"], rank=rank, world_size=world)
    numel, buckets = cfg["numel"], cfg["buckets"]
    net = nn.ParameterList([nn.Parameter(torch.zeros(numel)) for _ in range(buckets)])
    model = DDP(injector(net), bucket_cap_mb=numel * 4 / 2**20 / 2)
    state = flexcomm.FlexState(compressor="artopk-star", density=0.01)
    in_hook = [0.0]

    def timed_hook(state, bucket):
        started = time.perf_counter()
        try:
            return flexcomm.hook(state, bucket)
        finally:
            in_hook[0] += time.perf_counter() - started

    model.register_comm_hook(state, timed_hook)
    gen = torch.Generator().manual_seed(rank)
    rows = []
    for step in range(cfg["steps"]):
        grads = [torch.randn(numel, generator=gen) for _ in range(buckets)]
        loss = model(grads)
        dist.barrier()
        in_hook[0] = 0.0
        started = time.perf_counter()
        loss.backward()
        rows.append({"step": step, "backward_s": time.perf_counter() - started, "in_hook_s": in_hook[0]})
        model.zero_grad(set_to_none=True)
    Path(cfg["out"], f"{rank}.json").write_text(json.dumps(rows))
    dist.barrier()
    dist.destroy_process_group()


def injector(params):
    """A module whose loss ``sum_j sum(w_j * g_j)`` makes ``w_j.grad == g_j``."""
    from torch import nn

    class Injector(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weights = params

        def forward(self, grads):
            return sum((w * g).sum() for w, g in zip(self.weights, grads))

    return Injector()


def run_version(label: str, src: Path, cfg: dict) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        job = {**cfg, "init": f"file://{tmp}/rendezvous", "out": tmp}
        env = {**os.environ, "PYTHONPATH": f"{src}{os.pathsep}{Path(__file__).resolve().parent}"}
        code = "import json, sys, torch.multiprocessing as mp, hook_blocking as hb; cfg = json.loads(sys.argv[1]); mp.spawn(hb.spawned, args=(cfg,), nprocs=cfg['world'])"
        subprocess.run([sys.executable, "-c", code, json.dumps(job)], env=env, check=True)
        per_rank = [json.loads(Path(tmp, f"{r}.json").read_text()) for r in range(cfg["world"])]
    rows = []
    for step in range(WARMUP, cfg["steps"]):
        rows.append({"version": label, "step": step,
                     "backward_s": max(ranks[step]["backward_s"] for ranks in per_rank),
                     "in_hook_s": max(ranks[step]["in_hook_s"] for ranks in per_rank)})
    return rows


def spawned(rank: int, cfg: dict) -> None:
    worker(rank, cfg["world"], cfg)


def main() -> None:
    parser = argument_parser(__doc__)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--numel", type=float, default=1e6)
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args()
    cfg = {"steps": args.steps, "buckets": args.buckets, "numel": int(args.numel), "world": args.world}
    repo = Path(__file__).resolve().parent.parent
    rows = []
    with tempfile.TemporaryDirectory() as before_tree:
        archive = subprocess.run(["git", "-C", str(repo), "archive", BEFORE, "src"], check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", before_tree], input=archive, check=True)
        for label, src in ((f"before ({BEFORE})", Path(before_tree, "src")), ("now", repo / "src")):
            rows += run_version(label, src, cfg)
    write_csv(args.out_dir / "hook_blocking.csv", rows)
    lines = [f"command: {command_line()}", f"{cfg}", "", f"{'version':<20} {'in hook ms (median)':>20} {'backward ms (median)':>21}"]
    for label in dict.fromkeys(r["version"] for r in rows):
        mine = [r for r in rows if r["version"] == label]
        lines.append(f"{label:<20} {median([r['in_hook_s'] for r in mine]) * 1e3:>20.2f} {median([r['backward_s'] for r in mine]) * 1e3:>21.2f}")
    text = "\n".join(lines) + "\n"
    (args.out_dir / "hook_blocking.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
