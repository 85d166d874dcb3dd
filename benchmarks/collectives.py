"""Measured vs predicted time of gloo collectives and of flexcomm's exchanges on emulated links.

    python benchmarks/collectives.py [--quick] [--rates 1gbit,100mbit,10mbit] [--worlds 2,4]
                                     [--max-op-seconds 10] [--out-dir benchmarks/results]

For every link rate (an :class:`flexcomm.netem.EmulatedCluster`, tbf-shaped bridge, one
rank per host) and world size N, one job times

* the collectives ``allreduce``, ``allgather`` (size = each rank's contribution) and
  ``broadcast`` from preallocated float32 buffers, and
* the three exchanges through the real hook (:func:`flexcomm.hook` in DDP, one bucket
  holding a :class:`GradientInjector` parameter of the message size, density
  ``--density``): ``dense``, ``agtopk`` and ``artopk`` (``artopk-star``),

at message sizes 1 KB..100 MB.  Sizes whose nominal time (cost model at the link rate)
exceeds ``--max-op-seconds`` are skipped and listed (at 10 Mbit that is everything above
~10 MB; at 100 Mbit the largest allgather/broadcast at N=4).

Timing, as all ranks see it: before every timed op the ranks line up with a one-float
allreduce; each rank times the op; the job keeps the **max over ranks** (one allreduce(MAX)
at the end), so a broadcast's early-returning root never counts.  Rounds interleave every
(kind, size) so slow phases of the shared machine hit all alike; each point is the median
of its repeats.  An exchange's communication time is ``max_r(t_compress + t_exchange) -
max_r(t_compress)`` from the hook's :class:`flexcomm.BucketRecord`: the span from the hook
receiving the bucket to the averaged result, less the top-k selection on the critical path.

Fit: per (rate, N, collective kind) an :class:`flexcomm.cost.AlphaBetaEstimator` with
``forgetting=1.0`` (plain least squares on relative error, prior worth 1e-6 samples) over
the median time of every size; the exchanges are then *predicted* from the three fitted
kinds with :func:`flexcomm.cost.predict_exchange_times` (not fitted themselves).
Reported: median ``|predicted - measured| / measured`` over sizes >= 1 MB (target <= 20%).
A second fit uses the sizes >= 1 MB only: tbf's token bucket (2 ms of line rate, 250 KB
at 1 Gbit) lets messages of up to a few hundred KB leave faster than the rate, which an
alpha-beta line through all sizes cannot follow; both fits are reported.

Writes ``collectives.csv`` (one row per measured point, predictions of both fits),
``collectives_fit.json`` (fitted alpha/beta per rate, N, kind, both fits; read by
``sim_check.py``), ``collectives_errors.csv`` and ``collectives.png`` (measured points,
lines of the all-sizes fit, log-log, one panel per rate).  ``--refit`` recomputes the
fits, errors and plot from the measured columns of an existing ``collectives.csv``.

This module also holds the worker-side and launcher-side helpers the other benchmarks
import (``GradientInjector``, aligned timing, the job launcher with a progress bar).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flexcomm
from flexcomm.compress import k_for
from flexcomm.cost import AlphaBetaEstimator, CostParams, LinkParams, collective_time, predict_exchange_times
from flexcomm.netem import EmulatedCluster, netem_available, parse_rate
from flexcomm.launch import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"
COLLECTIVES = ("allreduce", "allgather", "broadcast")
EXCHANGES = ("dense", "agtopk", "artopk")
COMPRESSOR_OF = {"dense": "dense", "agtopk": "agtopk", "artopk": "artopk-star"}
SIZES = (1e3, 1e4, 1e5, 3.16e5, 1e6, 3.16e6, 1e7, 3.16e7, 1e8)
QUICK_SIZES = (1e3, 1e5, 1e6, 4e6)
ONE_MB = 1e6
PROGRESS = "@@progress"
TINY = 1
# What a rank's work costs on this machine, for planning only (MACHINE-NOTES.md):
# ~94% of the tbf rate reaches TCP, gloo's allgather is ~1.5x slower than its allreduce,
# flexcomm's top-k costs ~8 ns per element (one thread), per-op overhead ~0.3 ms.
_GOODPUT = 0.94
_ALLGATHER_PENALTY = 1.6
_TOPK_S_PER_ELEMENT = 8e-9
_OP_OVERHEAD_S = 3e-4


# ============================================================================ worker side
class GradientInjector(nn.Module):
    """One parameter whose gradient is exactly the tensor given to ``forward`` (loss = sum(w * g))."""

    def __init__(self, numel: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(numel))

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        return (self.weight * grad).sum()


class MultiInjector(nn.Module):
    """Several parameters (one per intended DDP bucket) whose gradients are given slices of ``g``."""

    def __init__(self, sizes: Sequence[int]) -> None:
        super().__init__()
        self.params = nn.ParameterList([nn.Parameter(torch.zeros(int(n))) for n in sizes])

    def forward(self, grad: torch.Tensor) -> torch.Tensor:
        parts = torch.split(grad, [p.numel() for p in self.params])
        return sum((p * g).sum() for p, g in zip(self.params, parts))


def init_worker() -> tuple[int, int]:
    """One thread per rank, join the env:// gloo group; returns ``(rank, world_size)``."""
    torch.set_num_threads(1)
    import datetime

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=900))
    return dist.get_rank(), dist.get_world_size()


def progress(step: int = 1) -> None:
    """Tell the launcher (from rank 0) that ``step`` more units of work are done."""
    if dist.get_rank() == 0:
        print(f"{PROGRESS} {step}", flush=True)


def align() -> None:
    """Line the ranks up before a timed op: two one-float allreduces.

    One is not enough: a rank leaves an allreduce once it has received what it needs,
    while its own last message (or a broadcast root's whole message) may still sit in a
    tbf queue, delaying the next op.  Leaving the second allreduce implies every rank
    finished the first, hence received everything sent before it.
    """
    tiny = torch.zeros(TINY)
    dist.all_reduce(tiny)
    dist.all_reduce(tiny)


def aligned_seconds(op: Callable[[], Any]) -> float:
    """This rank's time of ``op`` after lining the ranks up."""
    align()
    started = time.perf_counter()
    op()
    return time.perf_counter() - started


def max_over_ranks(values: Sequence[float]) -> list[float]:
    """Element-wise max over ranks of every rank's list of floats (one allreduce)."""
    if not values:
        return []
    t = torch.tensor(list(values), dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist()


def hooked_ddp(numel: int | Sequence[int], compressor: str | None, density: float, **state_args: Any
               ) -> tuple[nn.Module, flexcomm.FlexState | None]:
    """DDP around a gradient injector (one bucket per parameter), with flexcomm's hook or none.

    ``compressor=None`` gives plain DDP (its built-in allreduce).  ``init_sync=False``: the
    parameters are zeros on every rank anyway, and a model-sized broadcast at 10 Mbit
    would cost minutes.
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    if isinstance(numel, int):
        module: nn.Module = GradientInjector(numel)
        cap_mb = numel * 4 / 2**20 + 1
    else:
        module = MultiInjector(numel)
        cap_mb = max(numel) * 4 / 2**20  # one parameter per bucket: the caps are the sizes
    model = DDP(module, bucket_cap_mb=cap_mb, init_sync=False)
    if compressor is None:
        return model, None
    state = flexcomm.FlexState(compressor=compressor, density=density, **state_args)
    model.register_comm_hook(state, flexcomm.hook)
    return model, state


def train_step(model: nn.Module, grad: torch.Tensor) -> None:
    """Forward + backward of a gradient injector: the hook exchanges ``grad``."""
    model.zero_grad(set_to_none=True)
    model(grad).backward()


def rank_gradient(numel: int, seed: int = 0) -> torch.Tensor:
    """A standard-normal gradient, different on every rank."""
    gen = torch.Generator().manual_seed(1 + 7919 * dist.get_rank() + seed)
    return torch.randn(numel, generator=gen)


def worker_config() -> dict[str, Any] | None:
    """The config of a ``--worker CONFIG.json`` invocation, else ``None``."""
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return json.loads(Path(sys.argv[2]).read_text())
    return None


def write_result(cfg: dict[str, Any], result: Any) -> None:
    """Rank 0 writes the job's result where the launcher reads it."""
    if dist.get_rank() == 0:
        Path(cfg["result_path"]).write_text(json.dumps(result))


# ============================================================================ launcher side
def nominal_params(rate: str | float | None, alpha: float = 2e-4) -> CostParams:
    """Planning-only cost parameters of a link (``None``: loopback, ~20 Gbit/s)."""
    bps = 20e9 if rate is None else (parse_rate(rate) if isinstance(rate, str) else float(rate))
    link = LinkParams.from_bandwidth(alpha, bps * _GOODPUT)
    slower = LinkParams.from_bandwidth(alpha, bps * _GOODPUT / _ALLGATHER_PENALTY)
    return CostParams(allreduce=link, allgather=slower, broadcast=link)


def nominal_exchange_seconds(exchange: str, numel: int, density: float, n: int, params: CostParams) -> float:
    """Planning estimate of one exchange step: the cost model plus top-k on the critical path."""
    comm = predict_exchange_times(numel, density, n, params)[exchange]
    compute = 0.0 if exchange == "dense" else numel * _TOPK_S_PER_ELEMENT * max(1.0, n / 2)
    return comm + compute + _OP_OVERHEAD_S


def nominal_seconds(op: str, nbytes: float, n: int, params: CostParams, density: float = 0.1) -> float:
    """Planning estimate of one op of the collectives job."""
    if op in COLLECTIVES:
        return collective_time(op, nbytes, n, params) + _OP_OVERHEAD_S  # type: ignore[arg-type]
    return nominal_exchange_seconds(op, int(nbytes // 4), density, n, params)


@contextlib.contextmanager
def network(rate: str | None, n_hosts: int, prefix: str) -> Iterator[EmulatedCluster | None]:
    """An emulated cluster at ``rate`` (cleaned up on exit), or ``None`` for loopback."""
    if rate is None or rate == "loopback":
        yield None
        return
    with EmulatedCluster(n_hosts, rate, prefix=prefix) as cluster:
        yield cluster


def run_job(script: str, cluster: EmulatedCluster | None, n: int, cfg: dict[str, Any], total: int, desc: str,
            timeout: float) -> Any:
    """Run ``script --worker`` on ``n`` ranks with ``cfg``; show rank 0's progress; return its result."""
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="flexcomm-bench-") as tmp:
        cfg = {**cfg, "result_path": str(Path(tmp) / "result.json")}
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(cfg))
        with tqdm(total=total, desc=desc, unit="op", leave=True, dynamic_ncols=True) as bar:
            def on_line(rank: int, line: str) -> None:
                if line.startswith(PROGRESS):
                    bar.update(int(line.split()[1]))

            run_ranks(cluster, n, [sys.executable, str(Path(script).resolve()), "--worker", str(cfg_path)],
                      timeout=timeout, on_line=on_line)
        return json.loads((Path(cfg["result_path"])).read_text())


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def write_csv(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    """Rows (dicts with the same keys) to CSV."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as f:
        if not rows:
            return
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)


def require_emulation() -> None:
    """Exit with the reason when network emulation is unavailable."""
    ok, reason = netem_available()
    if not ok:
        raise SystemExit(f"network emulation unavailable: {reason}")


# ============================================================================ this benchmark: worker
def _collective_op(kind: str, nbytes: int, buf: torch.Tensor, out: torch.Tensor, world: int) -> Callable[[], Any]:
    numel = max(1, nbytes // 4)
    payload = buf[:numel]
    if kind == "allreduce":
        return lambda: dist.all_reduce(payload)
    if kind == "allgather":
        gathered = out[: numel * world]
        return lambda: dist.all_gather_into_tensor(gathered, payload)
    return lambda: dist.broadcast(payload, src=0)


def _time_collectives(plan: list[dict[str, Any]], world: int) -> list[tuple[int, int, list[float]]]:
    """Interleaved rounds over every collective entry; returns ``(entry, round, [t])`` locally."""
    entries = [(i, e) for i, e in enumerate(plan) if e["op"] in COLLECTIVES]
    if not entries:
        return []
    largest = max(max(1, e["bytes"] // 4) for _, e in entries)
    buf = torch.zeros(largest)
    out = torch.empty(largest * world)
    ops = {i: _collective_op(e["op"], e["bytes"], buf, out, world) for i, e in entries}
    for i, e in entries:
        if e["warmup"]:
            aligned_seconds(ops[i])
    samples = []
    for rnd in range(max(e["reps"] for _, e in entries)):
        for i, e in entries:
            if rnd < e["reps"]:
                samples.append((i, rnd, [aligned_seconds(ops[i])]))
                progress()
    return samples


def _exchange_sample(model: nn.Module, state: flexcomm.FlexState, grad: torch.Tensor) -> list[float]:
    """One aligned step; ``[wall, t_compress, t_compress + t_exchange]`` of this rank."""
    wall = aligned_seconds(lambda: train_step(model, grad))
    rec = state.drain_records()[-1]
    return [wall, rec.t_compress, rec.t_compress + rec.t_exchange]


def _time_exchanges(plan: list[dict[str, Any]], density: float) -> list[tuple[int, int, list[float]]]:
    """Per size: the exchanges side by side, in rotated order each round.

    An entry's own ``density`` (if any) overrides the job's.
    """
    samples = []
    by_size: dict[int, list[int]] = {}
    for i, e in enumerate(plan):
        if e["op"] in EXCHANGES:
            by_size.setdefault(e["bytes"], []).append(i)
    for nbytes in sorted(by_size):
        numel = max(1, nbytes // 4)
        grad = rank_gradient(numel)
        models = {i: hooked_ddp(numel, COMPRESSOR_OF[plan[i]["op"]], plan[i].get("density", density))
                  for i in by_size[nbytes]}
        for i, (model, state) in models.items():
            if plan[i]["warmup"]:
                _exchange_sample(model, state, grad)
        order = by_size[nbytes]
        for rnd in range(max(plan[i]["reps"] for i in order)):
            rotated = order[rnd % len(order):] + order[: rnd % len(order)]
            for i in rotated:
                if rnd < plan[i]["reps"]:
                    samples.append((i, rnd, _exchange_sample(*models[i], grad)))
                    progress()
        del models, grad
    return samples


def worker_main(cfg: dict[str, Any]) -> None:
    """One rank of the collectives job: time everything in ``cfg['plan']``, max over ranks."""
    _, world = init_worker()
    plan = cfg["plan"]
    samples = _time_collectives(plan, world) + _time_exchanges(plan, cfg["density"])
    flat = [t for _, _, ts in samples for t in ts]
    merged = iter(max_over_ranks(flat))
    result = [{"entry": i, "round": rnd, "times": [next(merged) for _ in ts]} for i, rnd, ts in samples]
    write_result(cfg, result)
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ this benchmark: launcher
def reps_for(seconds: float) -> int:
    """Repeats per point: many for fast ops (noisy), three for slow ones."""
    if seconds < 0.05:
        return 15
    if seconds < 0.5:
        return 5
    return 3


def make_plan(rate: str, n: int, sizes: Sequence[float], density: float, max_op_s: float
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The (op, bytes, reps, warm-up) entries of one job, and the skipped ones."""
    params = nominal_params(rate)
    plan, skipped = [], []
    for size in sizes:
        nbytes = int(round(size / (4 * n))) * 4 * n  # whole floats, divisible among ranks
        for op in (*COLLECTIVES, *EXCHANGES):
            est = nominal_seconds(op, nbytes, n, params, density)
            entry = {"op": op, "bytes": nbytes, "est_s": est, "reps": reps_for(est), "warmup": est < 2.0}
            (skipped if est > max_op_s else plan).append(entry)
    return plan, skipped


def plan_seconds(plan: Sequence[dict[str, Any]]) -> float:
    return sum(e["est_s"] * (e["reps"] + e["warmup"]) for e in plan)


def fit_kind(kind: str, points: Sequence[tuple[int, float]], n: int, rate_bps: float) -> LinkParams:
    """Least-squares (alpha, beta) of one collective kind over ``(bytes, median seconds)``."""
    est = AlphaBetaEstimator(kind, forgetting=1.0, prior=LinkParams.from_bandwidth(1e-4, rate_bps),
                             prior_weight=1e-6, prior_floor=1e-9)  # type: ignore[arg-type]
    for nbytes, seconds in points:
        est.observe(nbytes, n, seconds)
    return est.params


def point_rows(rate: str, n: int, plan: list[dict[str, Any]], raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per measured point: the median over its repeats (max-over-ranks times)."""
    per_entry: dict[int, list[list[float]]] = {}
    for s in raw:
        per_entry.setdefault(s["entry"], []).append(s["times"])
    rows = []
    for i, e in enumerate(plan):
        samples = per_entry.get(i, [])
        if e["op"] in COLLECTIVES:
            values, comp, wall = [s[0] for s in samples], 0.0, median([s[0] for s in samples])
        else:
            values = [s[2] - s[1] for s in samples]
            comp, wall = median([s[1] for s in samples]), median([s[0] for s in samples])
        rows.append({"rate": rate, "world_size": n, "kind": e["op"], "bytes": e["bytes"], "reps": len(samples),
                     "measured_s": median(values), "min_s": min(values), "compress_s": comp, "step_wall_s": wall})
    return rows


def fit_rows(rows: Sequence[dict[str, Any]], n: int, rate: str, min_bytes: float = 0.0) -> CostParams:
    """(alpha, beta) per collective kind over the rows' medians of at least ``min_bytes``."""
    fits = {kind: fit_kind(kind, [(r["bytes"], r["measured_s"]) for r in rows
                                  if r["kind"] == kind and r["bytes"] >= min_bytes], n, parse_rate(rate))
            for kind in COLLECTIVES}
    return CostParams(fits["allreduce"], fits["allgather"], fits["broadcast"])


def predict_row(row: dict[str, Any], n: int, params: CostParams, density: float) -> float:
    """The model's time of one row's collective or exchange (communication only)."""
    if row["kind"] in COLLECTIVES:
        return collective_time(row["kind"], row["bytes"], n, params)
    return predict_exchange_times(row["bytes"] // 4, density, n, params)[row["kind"]]


def add_predictions(rate: str, n: int, rows: list[dict[str, Any]], density: float) -> dict[str, CostParams]:
    """Fit on all sizes (the spec) and on sizes >= 1 MB only; add both predictions to ``rows``."""
    fits = {"all": fit_rows(rows, n, rate), "ge1MB": fit_rows(rows, n, rate, ONE_MB)}
    for r in rows:
        r["payload_bytes"] = _payload_bytes(r["kind"], r["bytes"], density)
        for label, params in fits.items():
            tag = "" if label == "all" else "_ge1MB_fit"
            r[f"predicted{tag}_s"] = predict_row(r, n, params, density)
            r[f"rel_error{tag}"] = (r[f"predicted{tag}_s"] - r["measured_s"]) / r["measured_s"]
    return fits


def _payload_bytes(kind: str, nbytes: int, density: float) -> int:
    """Bytes a rank hands the backend: the message, or the exchange's compressed payload."""
    if kind in ("agtopk", "artopk"):
        return k_for(nbytes // 4, density) * 8
    return nbytes


def error_table(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median |rel error| per (rate, N, kind): sizes >= 1 MB and all sizes; both fits."""
    out = []
    keys = sorted({(r["rate"], r["world_size"], r["kind"]) for r in rows},
                  key=lambda k: (-parse_rate(k[0]), k[1], (*COLLECTIVES, *EXCHANGES).index(k[2])))
    for rate, n, kind in keys:
        sel = [r for r in rows if (r["rate"], r["world_size"], r["kind"]) == (rate, n, kind)]
        big = [r for r in sel if r["bytes"] >= ONE_MB]
        out.append({"rate": rate, "world_size": n, "kind": kind, "points_ge_1MB": len(big),
                    "median_abs_rel_err_ge_1MB": median([abs(r["rel_error"]) for r in big]),
                    "max_abs_rel_err_ge_1MB": max((abs(r["rel_error"]) for r in big), default=math.nan),
                    "median_abs_rel_err_all": median([abs(r["rel_error"]) for r in sel]),
                    "points_all": len(sel),
                    "median_abs_rel_err_ge_1MB_ge1MB_fit": median([abs(r["rel_error_ge1MB_fit"]) for r in big])})
    return out


def plot(rows: Sequence[dict[str, Any]], rates: Sequence[str], path: Path) -> None:
    """Measured points and predicted lines, log-log, one panel per rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = dict(zip((*COLLECTIVES, *EXCHANGES), ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple",
                                                   "tab:brown")))
    markers, styles = {2: "o", 4: "s"}, {2: "-", 4: "--"}
    fig, axes = plt.subplots(1, len(rates), figsize=(6 * len(rates), 5), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for kind in (*COLLECTIVES, *EXCHANGES):
            for n in sorted({r["world_size"] for r in rows}):
                sel = sorted((r for r in rows if (r["rate"], r["kind"], r["world_size"]) == (rate, kind, n)),
                             key=lambda r: r["bytes"])
                if not sel:
                    continue
                x = [r["bytes"] for r in sel]
                ax.plot(x, [r["predicted_s"] for r in sel], styles[n], color=colors[kind], lw=1)
                ax.plot(x, [r["measured_s"] for r in sel], markers[n], color=colors[kind], ms=5,
                        mfc="none" if n == 4 else colors[kind], label=f"{kind} N={n}")
        ax.set(xscale="log", yscale="log", title=f"{rate}: measured (points) vs fitted model (lines)",
               xlabel="message bytes (allgather: per rank; exchanges: bucket bytes)", ylabel="seconds")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _fit_json(params: CostParams) -> dict[str, dict[str, float]]:
    return {k: {"alpha_s": v.alpha, "beta_s_per_byte": v.beta, "bandwidth_mbit": 8 / v.beta / 1e6 if v.beta else math.inf}
            for k, v in ((kind, params.link(kind)) for kind in COLLECTIVES)}


def measure(args: argparse.Namespace, rates: Sequence[str], worlds: Sequence[int], sizes: Sequence[float]
            ) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Run one job per (rate, N); returns the measured points and the skipped ops."""
    jobs = [(rate, n, *make_plan(rate, n, sizes, args.density, args.max_op_seconds)) for n in worlds for rate in rates]
    print(f"{len(jobs)} jobs, nominal {sum(plan_seconds(p) for *_, p, _ in jobs) / 60:.1f} min of ops")
    rows, skipped = [], []
    for rate, n, plan, skip in jobs:
        skipped += [{"rate": rate, "world_size": n, **{k: s[k] for k in ("op", "bytes", "est_s")}} for s in skip]
        with network(rate, n, "fcc") as cluster:
            raw = run_job(__file__, cluster, n, {"plan": plan, "density": args.density},
                          total=sum(e["reps"] for e in plan), desc=f"{rate} N={n}",
                          timeout=3 * plan_seconds(plan) + 600)
        rows += point_rows(rate, n, plan, raw)
    return rows, skipped


def reload_points(path: Path) -> list[dict[str, Any]]:
    """The measured columns of an earlier ``collectives.csv`` (to refit without measuring again)."""
    with path.open() as f:
        return [{"rate": r["rate"], "world_size": int(r["world_size"]), "kind": r["kind"], "bytes": int(r["bytes"]),
                 "reps": int(r["reps"]), **{k: float(r[k]) for k in ("measured_s", "min_s", "compress_s", "step_wall_s")}}
                for r in csv.DictReader(f)]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: 1gbit+100mbit, N=2, four sizes")
    parser.add_argument("--rates", default="1gbit,100mbit,10mbit")
    parser.add_argument("--worlds", default="2,4")
    parser.add_argument("--density", type=float, default=0.1, help="density of the AG/AR exchanges")
    parser.add_argument("--max-op-seconds", type=float, default=10.0, help="skip ops whose nominal time exceeds this")
    parser.add_argument("--refit", action="store_true",
                        help="no measurement: refit and re-plot the measured points of an earlier run's CSV")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    rates = ["1gbit", "100mbit"] if args.quick else args.rates.split(",")
    worlds = [2] if args.quick else [int(w) for w in args.worlds.split(",")]
    suffix = "_quick" if args.quick else ""
    fit_path = args.out_dir / f"collectives_fit{suffix}.json"
    if args.refit:
        rows = reload_points(args.out_dir / f"collectives{suffix}.csv")
        previous = json.loads(fit_path.read_text())
        skipped, command = previous["skipped"], previous["command"] + "  (refit: " + " ".join(sys.argv) + ")"
    else:
        require_emulation()
        rows, skipped = measure(args, rates, worlds, QUICK_SIZES if args.quick else SIZES)
        command = " ".join(["python", *sys.argv])
    fits, fits_large = {}, {}
    for rate, n in dict.fromkeys((r["rate"], r["world_size"]) for r in rows):
        job = [r for r in rows if (r["rate"], r["world_size"]) == (rate, n)]
        both = add_predictions(rate, n, job, args.density)
        fits[f"{rate}/N={n}"], fits_large[f"{rate}/N={n}"] = _fit_json(both["all"]), _fit_json(both["ge1MB"])
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(args.out_dir / f"collectives{suffix}.csv", rows)
    errors = error_table(rows)
    write_csv(args.out_dir / f"collectives_errors{suffix}.csv", errors)
    fit_path.write_text(json.dumps({"fits": fits, "fits_ge1MB": fits_large, "density": args.density,
                                    "skipped": skipped, "command": command}, indent=2))
    plot(rows, list(dict.fromkeys(r["rate"] for r in rows)), args.out_dir / f"collectives{suffix}.png")
    _print_report(errors, fits, fits_large, skipped)
    return 0


def _print_report(errors: Sequence[dict[str, Any]], fits: dict[str, Any], fits_large: dict[str, Any],
                  skipped: Sequence[dict[str, Any]]) -> None:
    print("\nmedian |predicted - measured| / measured over sizes >= 1 MB (target <= 20%)")
    print("  fit on all sizes (spec)  |  fit on sizes >= 1 MB  |  all sizes, fit on all")
    for e in errors:
        flag = "ok  " if e["median_abs_rel_err_ge_1MB"] <= 0.20 else "MISS"
        print(f"  {flag} {e['rate']:>8} N={e['world_size']} {e['kind']:>9}: {100 * e['median_abs_rel_err_ge_1MB']:5.1f}% "
              f"(n={e['points_ge_1MB']}, max {100 * e['max_abs_rel_err_ge_1MB']:5.1f}%) | "
              f"{100 * e['median_abs_rel_err_ge_1MB_ge1MB_fit']:5.1f}% | {100 * e['median_abs_rel_err_all']:5.1f}%")
    for label, table in (("all sizes", fits), (">= 1 MB", fits_large)):
        print(f"\nfitted alpha / bandwidth (fit on {label})")
        for key, kinds in table.items():
            print("  " + key + ": " + ", ".join(f"{k} {v['alpha_s'] * 1e3:.3f} ms / {v['bandwidth_mbit']:.0f} Mbit/s"
                                                for k, v in kinds.items()))
    if skipped:
        print("\nskipped (nominal time > limit): " + "; ".join(
            f"{s['rate']} N={s['world_size']} {s['op']} {s['bytes'] / 1e6:g} MB ({s['est_s']:.0f} s)" for s in skipped))


if __name__ == "__main__":
    config = worker_config()
    if config is not None:
        worker_main(config)
    else:
        raise SystemExit(main())
