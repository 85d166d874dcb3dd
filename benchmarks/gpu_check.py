"""The GPU check: is flexcomm correct and fast on CUDA?  One command, a few minutes.

    python benchmarks/gpu_check.py            # on a machine with 1 or more GPUs
    python benchmarks/gpu_check.py --cpu      # the same checks on CPU tensors (tests the script here)

With one GPU two ranks share it over gloo with CUDA tensors (NCCL refuses two ranks on
one GPU); with N >= 2 GPUs, N ranks over NCCL, one GPU each.  Without a GPU (and
without ``--cpu``) it says so and exits 0.

Checks, each PASS/FAIL in ``benchmarks/results/gpu_check.json`` (``gpu_check_cpu.json``
for ``--cpu``):

* ``invariants/<compressor>/<dtype>``: every compressor x {fp32, bf16, fp16} on a model
  with one bucket per parameter whose gradients are known (a 64 x 48 matrix each for
  ``lowrank``, which factors matrices and sends vectors whole), forward and backward inside
  a user stream, a ``torch.cuda._sleep`` before every exchange (a missed stream wait
  shows as stale data): every rank holds the same update bit for bit each step, and
  nothing is lost or counted twice -- ``sum of gradients == N * sum of updates + sum of
  residuals`` over all ranks and steps (to the dtype's rounding of what was sent);
* ``reference/<compressor>`` (fp32: dense, agtopk, artopk-star): each step's update
  equals a plain-torch reference of the algorithm;
* ``replicas``: an MLP trained 200 steps with ``flex`` + ``density="auto"`` has the
  same parameters on every rank (hash);
* ``host_syncs`` (CUDA): ``torch.cuda.set_sync_debug_mode("warn")`` over steady-state
  steps of every compressor (``lowrank`` included: its QR may sync): host synchronisations
  per step (the state reads the step's outcomes once);
* ``timing`` (CUDA): a dense bucket's recorded exchange time within 2x of a CUDA-event
  timed allreduce of the same size;
* ``memory`` (CUDA): peak memory with AR-Topk at most plain DDP's plus the gradient bytes
  (the residual) plus the largest bucket (the selection's transient);
* ``dense_speed`` (CUDA): ``flex`` at density 1.0 within 10% of the faster of plain DDP and
  PyTorch's ``fp16_compress_hook`` (3 interleaved rounds, median step time each).

Not covered here: Lightning and Accelerate checkpoints on GPU (their CPU tests cover
the per-rank round trip).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import math
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import flexcomm
from common import RESULTS
from flexcomm.comm import control_device
from flexcomm.compress import k_for
from flexcomm.exchange import EXCHANGES

COMPRESSORS = ("dense", "agtopk", "mstopk", "artopk-star", "artopk-var", "flex", "flex-dense16", "lowrank")
#: The invariants' flex runs without dense16 (exact error feedback); ``flex-dense16`` with it, whose
#: fp16 rounding is not fed back: it is held to fp16's tolerance whatever the gradient's dtype.
SETTINGS = {"flex": {"compressor": "flex", "dense16": False}, "flex-dense16": {"compressor": "flex"}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BUCKETS, NUMEL, DENSITY, STEPS = 6, 1 << 14, 0.02, 12
MATRIX = (64, 48)  # the low-rank invariants' parameter: a matrix its rank-4 factors make 7x smaller
SLEEP_CYCLES = 2_000_000  # ~1 ms on a current GPU: long enough for a race to show


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run the checks on CPU tensors (no CUDA-only checks)")
    parser.add_argument("--replica-steps", type=int, default=200, help="steps of the replica check (default: 200)")
    args = parser.parse_args(argv)
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if gpus == 0 and not args.cpu:
        print("gpu_check: no CUDA device here; skipped (run with --cpu to exercise the checks on CPU tensors)")
        return 0
    world = 2 if args.cpu or gpus == 1 else gpus
    backend = "nccl" if not args.cpu and gpus >= 2 else "gloo"
    print(f"gpu_check: {world} ranks, {backend}, {'CPU' if args.cpu else torch.cuda.get_device_name(0)}", flush=True)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank_main, args=(world, backend, args.cpu, args.replica_steps, tmp), nprocs=world, join=True)
        results = json.loads((Path(tmp) / "0.json").read_text())
    results["environment"] = {"torch": torch.__version__, "world": world, "backend": backend,
                              "device": "cpu" if args.cpu else torch.cuda.get_device_name(0),
                              "seconds": round(time.perf_counter() - started, 1)}  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / ("gpu_check_cpu.json" if args.cpu else "gpu_check.json")
    out.write_text(json.dumps(results, indent=2) + "\n")
    failed = [name for name, check in results["checks"].items() if not check["ok"]]
    for name, check in results["checks"].items():
        print(f"{'PASS' if check['ok'] else 'FAIL'}  {name}: {check['detail']}")
    print(f"gpu_check: {len(results['checks']) - len(failed)} passed, {len(failed)} failed; {out}")
    return 1 if failed else 0


def _rank_main(rank: int, world: int, backend: str, cpu: bool, replica_steps: int, tmp: str) -> None:
    device = torch.device("cpu") if cpu else torch.device("cuda", rank % torch.cuda.device_count())
    if device.type == "cuda":
        torch.cuda.set_device(device)
    quiet = getattr(torch.autograd.graph, "set_warn_on_accumulate_grad_stream_mismatch", None)
    if quiet is not None:
        quiet(False)  # the invariants run backward in a side stream on purpose
    init = f"file://{Path(tmp) / 'rendezvous'}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    checks: dict[str, dict] = {}
    try:
        _slow_down_exchanges()
        for name in COMPRESSORS:
            for label, dtype in DTYPES.items():
                checks.update(_invariants(name, label, dtype, device))
        checks["replicas"] = _replicas(device, replica_steps)
        if device.type == "cuda":
            checks["host_syncs"] = _host_syncs(device)
            checks["timing"] = _timing(device)
            checks["memory"] = _memory(device)
            checks["dense_speed"] = _dense_speed(device)
    finally:
        Path(tmp, f"{rank}.json").write_text(json.dumps({"checks": checks}))
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


def _slow_down_exchanges() -> None:
    """Sleep on the exchange's stream before each exchange: a missing wait reads stale or half-written data."""
    for name, run in list(EXCHANGES.items()):
        def slowed(job, run=run):
            if job.grad.is_cuda:
                torch.cuda._sleep(SLEEP_CYCLES)
            return run(job)
        EXCHANGES[name] = slowed


class _KnownGradients(nn.Module):
    """``loss = sum_j sum(w_j * g_j)``: each parameter's gradient is exactly ``g_j``."""

    def __init__(self, dtype: torch.dtype, device: torch.device, shape: tuple[int, ...] = (NUMEL,)) -> None:
        super().__init__()
        self.weights = nn.ParameterList([nn.Parameter(torch.zeros(shape, dtype=dtype, device=device)) for _ in range(BUCKETS)])

    def forward(self, grads: list[torch.Tensor]) -> torch.Tensor:
        return sum((w * g).sum() for w, g in zip(self.weights, grads))


def _gradients(rank: int, step: int, dtype: torch.dtype, device: torch.device,
               shape: tuple[int, ...] = (NUMEL,)) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    return [(torch.randn(shape, generator=gen) * (j + 1)).to(dtype).to(device) for j in range(BUCKETS)]


def _in_user_stream(device: torch.device) -> contextlib.AbstractContextManager:
    """A side stream to run forward and backward in (CUDA), else a no-op context."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    return torch.cuda.stream(stream)


def _invariants(name: str, label: str, dtype: torch.dtype, device: torch.device) -> dict[str, dict]:
    rank, world = dist.get_rank(), dist.get_world_size()
    shape = MATRIX if name == "lowrank" else (NUMEL,)
    numel = math.prod(shape)  # below, each parameter's gradient, update and residual are flat
    model = DDP(_KnownGradients(dtype, device, shape), bucket_cap_mb=numel * 2 / 2**20 / 2)
    state = flexcomm.register(model, density=1.0 if name == "dense" else DENSITY, **SETTINGS.get(name, {"compressor": name}))
    model([torch.zeros(shape, dtype=dtype, device=device)] * BUCKETS).backward()  # DDP's bucket rebuild
    total_grads = torch.zeros(BUCKETS, numel, dtype=torch.float64)
    total_updates = torch.zeros(BUCKETS, numel, dtype=torch.float64)
    same, updates = True, []
    for step in range(STEPS):
        grads = _gradients(rank, step, dtype, device, shape)
        model.zero_grad(set_to_none=True)
        with _in_user_stream(device):
            model(grads).backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        update = torch.stack([w.grad.detach().double().cpu().flatten() for w in model.module.weights])
        updates.append(update)
        same &= _same_on_every_rank(update)
        for r in range(world):
            total_grads += torch.stack([g.double().flatten() for g in _gradients(r, step, dtype, torch.device("cpu"), shape)])
        total_updates += update
    residual = torch.zeros(BUCKETS, numel, dtype=torch.float64)
    pieces = state.memory.state_dict()["pieces"]  # per parameter name (buckets run in reverse order)
    for j in range(BUCKETS):
        if f"weights.{j}" in pieces:
            residual[j] = pieces[f"weights.{j}"].double()
    residual = residual.to(device)
    dist.all_reduce(residual)
    lost = (total_grads - world * total_updates - residual.cpu()).abs().max().item()
    scale = total_grads.abs().max().item()
    # What the dtype's rounding of the sent values may cost per step, relative to the largest gradient.
    tolerance = {torch.float32: 1e-6, torch.bfloat16: 1.5e-3, torch.float16: 2e-4}[dtype] * STEPS
    if name == "flex-dense16":
        tolerance = max(tolerance, 2e-4 * STEPS)
    used = sorted({record.exchange for record in state.drain_records()})
    checks = {f"invariants/{name}/{label}": {
        "ok": bool(same and lost <= tolerance * scale),
        "detail": f"replicas identical every step: {same}; max |sum g - N sum update - sum e| = {lost:.3g} "
                  f"(scale {scale:.3g}, tolerance {tolerance * scale:.3g}); exchanges {used}",
    }}  # fmt: skip
    if dtype == torch.float32 and name in ("dense", "agtopk", "artopk-star"):
        expected = _reference(name, world)
        worst = max(((u - e).abs().max() / e.abs().max()).item() for u, e in zip(updates, expected))
        checks[f"reference/{name}"] = {"ok": worst <= 1e-6, "detail": f"max |update - reference| / max |reference| = {worst:.3g}"}
    return checks


def _reference(name: str, world: int) -> list[torch.Tensor]:
    """The algorithm in plain torch (fp64 on CPU), every rank simulated: ``a = g + e``, ranks send ``a[I] / N``."""
    k = k_for(NUMEL, DENSITY)
    residuals = torch.zeros(world, BUCKETS, NUMEL, dtype=torch.float64)
    out = []
    for step in range(STEPS):
        grads = torch.stack([torch.stack(_gradients(r, step, torch.float32, torch.device("cpu"))) for r in range(world)]).double()
        if name == "dense":
            out.append(grads.mean(0))
            continue
        update = torch.zeros(BUCKETS, NUMEL, dtype=torch.float64)
        for j in range(BUCKETS):
            a = grads[:, j] + residuals[:, j]
            leader = (step + 1) % world  # the state's step counter counts the rebuild step
            chosen = [a[leader].abs().topk(k).indices] * world if name == "artopk-star" else [a[r].abs().topk(k).indices for r in range(world)]
            for r in range(world):
                update[j].index_add_(0, chosen[r], a[r, chosen[r]] / world)
                residuals[r, j] = a[r].index_fill(0, chosen[r], 0)
        out.append(update)
    return out


def _same_on_every_rank(tensor: torch.Tensor) -> bool:
    digest = torch.tensor(list(hashlib.sha256(tensor.numpy().tobytes()).digest()[:8]), dtype=torch.float64)
    device = control_device(None)
    gathered = [torch.zeros_like(digest, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, digest.to(device))
    return all(torch.equal(g.cpu(), digest) for g in gathered)


def _mlp(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)).to(device)


def _replicas(device: torch.device, steps: int) -> dict:
    rank = dist.get_rank()
    model = DDP(_mlp(device), bucket_cap_mb=0.25)
    flexcomm.register(model, compressor="flex", density="auto")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(64, 256, generator=gen).to(device), torch.randint(0, 10, (64,), generator=gen).to(device)
        optimizer.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    params = torch.cat([p.detach().double().cpu().flatten() for p in model.parameters()])
    same = _same_on_every_rank(params)
    return {"ok": same, "detail": f"parameters identical on every rank after {steps} flex+auto steps: {same}"}


def _host_syncs(device: torch.device) -> dict:
    steps, counts = 20, {}
    for name in COMPRESSORS:
        model = DDP(_mlp(device), bucket_cap_mb=0.25)
        flexcomm.register(model, density=1.0 if name == "dense" else DENSITY, **SETTINGS.get(name, {"compressor": name}))
        x = torch.randn(64, 256, device=device)
        for _ in range(12):
            model(x).square().mean().backward()
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            for _ in range(steps):
                model(x).square().mean().backward()
            torch.cuda.set_sync_debug_mode("default")
        counts[name] = sum("synchroniz" in str(w.message) for w in caught) / steps
    worst = max(counts.values())
    return {"ok": worst <= 2.0, "detail": f"host synchronisations per step (goal <= 1; per bucket would be >= 5): {counts}"}


def _timing(device: torch.device) -> dict:
    numel = 1 << 24
    layer = nn.Linear(4096, 4096, bias=False).to(device)
    ddp = DDP(layer, bucket_cap_mb=1000)
    state = flexcomm.register(ddp, compressor="dense", density=1.0)
    x = torch.randn(8, 4096, device=device)
    for _ in range(5):
        ddp(x).sum().backward()
    torch.cuda.synchronize(device)
    recorded = [r.t_exchange for r in state.drain_records()][-3:]
    payload = torch.randn(numel, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(3):
        start.record()
        dist.all_reduce(payload)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    ratio = (sum(recorded) / len(recorded)) / (sum(times) / len(times))
    return {"ok": 0.5 <= ratio <= 2.0, "detail": f"recorded / CUDA-event allreduce time of 64 MB = {ratio:.2f} (goal 0.5-2)"}


def _memory(device: torch.device) -> dict:
    peaks, bucket_bytes = {}, 25 * 2**20  # DDP's default bucket cap
    for name in ("plain", "artopk-star"):
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        ddp = DDP(nn.Sequential(nn.Linear(4096, 4096), nn.Linear(4096, 1024)).to(device))
        grad_bytes = sum(p.numel() * p.element_size() for p in ddp.parameters())
        if name != "plain":
            flexcomm.register(ddp, compressor=name, density=0.01)
        x = torch.randn(32, 4096, device=device)
        for _ in range(5):
            ddp(x).sum().backward()
        torch.cuda.synchronize(device)
        peaks[name] = torch.cuda.max_memory_allocated(device)
        del ddp
    extra = (peaks["artopk-star"] - peaks["plain"]) / grad_bytes
    goal = 1.0 + bucket_bytes / grad_bytes
    return {"ok": extra <= goal, "detail": f"extra peak memory = {extra:.2f} x gradient bytes (goal <= {goal:.2f}: "
                                           "residual + one bucket's selection)"}


def _dense_speed(device: torch.device) -> dict:
    """Step time of plain DDP, PyTorch's fp16 hook and flex at density 1.0, measured in interleaved rounds."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    models, exchanges = {}, {}
    for name in ("plain", "fp16-hook", "flex"):
        torch.manual_seed(0)
        ddp = models[name] = DDP(nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).to(device))
        if name == "fp16-hook":
            ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif name == "flex":
            state = flexcomm.register(ddp, compressor="flex", density=1.0)
    x = torch.randn(64, 2048, device=device)
    times: dict[str, list[float]] = {name: [] for name in models}
    for round_ in range(3):
        for name, ddp in models.items():
            for _ in range(10 if round_ == 0 else 3):
                ddp(x).square().mean().backward()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                ddp(x).square().mean().backward()
            end.record()
            end.synchronize()
            times[name].append(start.elapsed_time(end) / 20)
    for record in state.drain_records()[-40:]:
        exchanges[record.exchange] = exchanges.get(record.exchange, 0) + 1
    median = {name: sorted(t)[1] for name, t in times.items()}
    ratio = median["flex"] / min(median["plain"], median["fp16-hook"])
    return {"ok": ratio <= 1.10, "detail": f"flex (density 1.0) / faster of plain DDP and fp16 hook = {ratio:.3f} (goal <= 1.10); "
                                           f"median ms: { {n: round(t, 2) for n, t in median.items()} }; flex's last exchanges: {exchanges}"}


if __name__ == "__main__":
    sys.exit(main())
