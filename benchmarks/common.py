"""What the benchmarks share: the ranks of a job, launching and planning jobs, CSV, plots.

A benchmark script is also its own worker: the launcher runs ``script --worker CONFIG.json``
on N ranks (:func:`run_job`, one rank per emulated host or on loopback) and the script ends
with ``main_or_worker(main, worker_main)``.  Rank 0 reports progress (``@@progress k`` lines,
a tqdm bar in the launcher) and writes the job's JSON result where the launcher reads it.

Timing, as all ranks see it (:func:`aligned_seconds`): the ranks line up before every timed
op, each rank times the op, and the job keeps the **max over ranks**
(:func:`max_over_ranks`), so a broadcast's early-returning root never counts.

The op-timing job and the (alpha, beta) fits built on it are in :mod:`op_timing`.

Planning (:func:`nominal_params`) uses what ops cost on this machine (MACHINE-NOTES.md):
~94% of the tbf rate reaches TCP, gloo's allgather is ~1.5x slower than its allreduce,
flexcomm's top-k costs ~8 ns per element (one thread), per-op overhead ~0.3 ms.  These only
size jobs (repeats, skips, timeouts); no reported number comes from them.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
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
from flexcomm.cost import CostParams, LinkParams, collective_time, predict_exchange_times
from flexcomm.netem import EmulatedCluster, netem_available, parse_rate
from flexcomm.launch import run_ranks

RESULTS = Path(__file__).resolve().parent / "results"
COLLECTIVES = ("allreduce", "allgather", "broadcast")
EXCHANGES = ("dense", "agtopk", "artopk")
#: The exchange a benchmark names -> the compressor that runs it (AR-Topk with round-robin leaders).
COMPRESSOR_OF = {"dense": "dense", "agtopk": "agtopk", "artopk": "artopk-star", "flex": "flex"}
#: One colour per exchange (and flex), and per collective, in every plot that compares them.
EXCHANGE_COLORS = {"dense": "tab:blue", "agtopk": "tab:orange", "artopk": "tab:green", "flex": "tab:red"}
COLLECTIVE_COLORS = {"allreduce": "tab:blue", "allgather": "tab:orange", "broadcast": "tab:green"}
ONE_MB = 1e6
PROGRESS = "@@progress"
GOODPUT = 0.94
ALLGATHER_PENALTY = 1.6
TOPK_S_PER_ELEMENT = 8e-9
OP_OVERHEAD_S = 3e-4


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
    tiny = torch.zeros(1)
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


def finish_worker(cfg: dict[str, Any], result: Any) -> None:
    """Rank 0 writes the job's result where the launcher reads it; every rank leaves the group."""
    if dist.get_rank() == 0:
        Path(cfg["result_path"]).write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def main_or_worker(main: Callable[[], int], worker: Callable[[dict[str, Any]], None]) -> None:
    """A benchmark script's entry: ``script --worker CONFIG.json`` runs one rank, anything else ``main``."""
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        worker(json.loads(Path(sys.argv[2]).read_text()))
    else:
        raise SystemExit(main())


# ============================================================================ launcher side
def nominal_params(rate: str | float | None, alpha: float = 2e-4) -> CostParams:
    """Planning-only cost parameters of a link (``None``: loopback, ~20 Gbit/s)."""
    bps = 20e9 if rate is None else (parse_rate(rate) if isinstance(rate, str) else float(rate))
    link = LinkParams.from_bandwidth(alpha, bps * GOODPUT)
    slower = LinkParams.from_bandwidth(alpha, bps * GOODPUT / ALLGATHER_PENALTY)
    return CostParams(allreduce=link, allgather=slower, broadcast=link)


def nominal_exchange_seconds(exchange: str, numel: int, density: float, n: int, params: CostParams) -> float:
    """Planning estimate of one exchange step: the cost model plus top-k on the critical path."""
    comm = predict_exchange_times(numel, density, n, params)[exchange]
    compute = 0.0 if exchange == "dense" else numel * TOPK_S_PER_ELEMENT * max(1.0, n / 2)
    return comm + compute + OP_OVERHEAD_S


def nominal_seconds(op: str, nbytes: float, n: int, params: CostParams, density: float = 0.1) -> float:
    """Planning estimate of one op of the op-timing job."""
    if op in COLLECTIVES:
        return collective_time(op, nbytes, n, params) + OP_OVERHEAD_S  # type: ignore[arg-type]
    return nominal_exchange_seconds(op, int(nbytes // 4), density, n, params)


@contextlib.contextmanager
def network(rate: str | None, n_hosts: int, prefix: str) -> Iterator[EmulatedCluster | None]:
    """An emulated cluster at ``rate`` (cleaned up on exit), or ``None`` for loopback."""
    if rate is None or rate == "loopback":
        yield None
        return
    with EmulatedCluster(n_hosts, rate, prefix=prefix) as cluster:
        yield cluster


def run_job(script: str, cluster: EmulatedCluster | None, n: int, cfg: dict[str, Any], total: int | None, desc: str,
            timeout: float, on_line: Callable[[int, str], None] | None = None) -> Any:
    """Run ``script --worker`` on ``n`` ranks with ``cfg``; show rank 0's progress; return its result.

    ``on_line(rank, line)`` sees every other line the ranks print while they run.
    """
    from tqdm import tqdm

    with tempfile.TemporaryDirectory(prefix="flexcomm-bench-") as tmp:
        cfg = {**cfg, "result_path": str(Path(tmp) / "result.json")}
        cfg_path = Path(tmp) / "config.json"
        cfg_path.write_text(json.dumps(cfg))
        with tqdm(total=total, desc=desc, unit="op", leave=True, dynamic_ncols=True) as bar:
            def read_line(rank: int, line: str) -> None:
                if line.startswith(PROGRESS):
                    bar.update(int(line.split()[1]))
                elif on_line is not None:
                    on_line(rank, line)

            run_ranks(cluster, n, [sys.executable, str(Path(script).resolve()), "--worker", str(cfg_path)],
                      timeout=timeout, on_line=read_line)
        return json.loads(Path(cfg["result_path"]).read_text())


def require_emulation() -> None:
    """Exit with the reason when network emulation is unavailable."""
    ok, reason = netem_available()
    if not ok:
        raise SystemExit(f"network emulation unavailable: {reason}")


def argument_parser(doc: str, quick: str | None = None, **lists: str) -> argparse.ArgumentParser:
    """A benchmark's options: ``--out-dir`` (default ``benchmarks/results``), ``--quick`` (a smoke run, as
    ``quick`` describes it; its outputs get a ``_quick`` suffix) and one comma-separated list option per
    keyword: ``rates="1gbit,100mbit"`` is ``--rates`` with that default (parse it with :func:`numbers`).
    """
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    if quick is not None:
        parser.add_argument("--quick", action="store_true", help=quick)
    for name, default in lists.items():
        parser.add_argument("--" + name.replace("_", "-"), default=default, help=f"comma-separated (default {default})")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    return parser


def proc_status_kib(field: str, pid: int | str = "self") -> int:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``, ...); OSError if the process is gone."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def command_line() -> str:
    """The command that produced a result, for its JSON."""
    return " ".join(["python", *sys.argv])


def numbers(text: str, kind: Callable[[str], Any] = float) -> list[Any]:
    """A comma-separated option as a list: ``numbers("1e6,8e6", int)`` is ``[1000000, 8000000]``."""
    return [kind(float(x)) if kind is int else kind(x) for x in text.split(",")]


def median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def bandwidth_mbit(beta: float) -> float:
    """``8 / beta`` in Mbit/s (infinite for a zero beta)."""
    return 8 / beta / 1e6 if beta > 0 else math.inf


# ============================================================================ outputs
def write_csv(path: Path, rows: Sequence[dict[str, Any]], float_format: str | None = None) -> None:
    """Rows to CSV: the columns are every key in first-seen order; a missing value or ``None`` is empty.

    ``float_format`` (e.g. ``".6g"``) rounds floats; by default they are written in full.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with path.open("w", newline="") as f:
        if not rows:
            return
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: _csv_value(row.get(k), float_format) for k in keys})


def _csv_value(value: Any, float_format: str | None) -> Any:
    if value is None:
        return ""
    if float_format is not None and isinstance(value, float):
        return format(value, float_format)
    return value


def figure(nrows: int = 1, ncols: int = 1, *, figsize: tuple[float, float], **kwargs: Any) -> tuple[Any, Any]:
    """A figure and its axes (a 2-D array, or per ``squeeze`` / ``sharex`` ... in ``kwargs``) on the Agg canvas.

    matplotlib's object API: no display, no pyplot global state.
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize)
    return fig, fig.subplots(nrows, ncols, **{"squeeze": False, **kwargs})


def save(fig: Any, path: Path, dpi: int = 120) -> None:
    """Lay the figure out tightly and write it."""
    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
