"""Local work of one AR-Topk / AG-Topk bucket, in copies of the bucket, and its peak extra memory.

    python benchmarks/local_work.py [--sizes 6.25e6,2.5e7] [--densities 0.01] [--repeats 9] [--quick]

Everything a rank does to one bucket of M float32 elements besides communicating, timed
in one process on one thread against the floor, one copy of the bucket (``buf.copy_(g)``
into a preallocated buffer).  A steady-state step: the bucket carries a residual.

``before_*``  the hook at commit d1e7473 (the roles split, before the fused path), op by op:
              ``a = g + e`` in place in the bucket, ``||a||`` and finiteness read to the host,
              the selection (leader only), the values and their gain read to the host,
              the residual copied from ``a`` and its sent indices zeroed, the bucket zeroed
              and the update scattered.
``after_*``   today's code itself (:meth:`flexcomm.compress.ResidualMemory.accumulate`, then
              :mod:`flexcomm.exchange.artopk` and :mod:`~flexcomm.exchange.allgather`): one
              pass for ``a = g + e`` over the residual, the bucket zeroed, the norm and, on a
              selecting rank, the top-k (:mod:`flexcomm.compress.fused`); the values; the
              residual committed by zeroing k entries; the update scattered; plus the step's
              settle (one host read).

The collective's result is stood in for by the values themselves (k elements: it does
not change the local work).  Times are the calling thread's CPU time
(``time.thread_time``, one torch thread): on a shared machine wall time also counts
whatever other processes held the core meanwhile.  Rounds interleave all methods in an
order rotated per round; reported are the median time and median / median floor
("copies").  Before the timed rounds, before and after are checked to produce the same
update bit for bit.

Peak extra memory: each method once more in a child process of its own, with glibc's
mmap threshold fixed at 128 KiB (``MALLOC_MMAP_THRESHOLD_``: every large buffer is mapped
when allocated and unmapped when freed, so resident memory follows live buffers), the
kernel's peak-RSS mark reset (``/proc/self/clear_refs``) once the bucket's gradient and
the residual's source exist and the method ran once on a small bucket (the libraries'
code pages); then two steps (the first allocates the residual, workspaces
and buffers).  Reported: the peak resident growth in copies of the bucket (what the
method holds beyond DDP's own bucket: the residual counts).

Writes ``local_work.csv``, ``local_work.png`` and ``local_work.txt`` under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

import flexcomm
from common import argument_parser, command_line, figure, median, numbers, proc_status_kib, save, write_csv
from flexcomm.compress import ResidualMemory, TopkWorkspace, k_for, topk_indices
from flexcomm.compress.stats import to_host
from flexcomm.exchange import BucketJob, RoundRobin
from flexcomm.exchange import allgather, artopk
from flexcomm.exchange.job import DeviceOutcome

WORLD = 2  # the update's division; no communication happens
METHODS = ("floor", "before_leader", "before_follower", "after_leader", "after_follower", "after_agtopk")
Timed = tuple[Callable[[], object], Callable[[], object]]  # (untimed set-up, timed work)


def heavy_gradient(numel: int, seed: int) -> torch.Tensor:
    """Normal times a log-normal scale: heavy-tailed like real gradients."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(numel, generator=gen).mul_(torch.randn(numel, generator=gen).exp_())


class Bucket:
    """One bucket: its gradient ``g``, the residual ``e`` it carries, and the indices a follower receives.

    Before every timed call an untimed set-up restores the bucket buffer to ``g`` and the
    memory's residual to ``e``, so every repeat does the same work.
    """

    def __init__(self, numel: int, density: float) -> None:
        self.g = heavy_gradient(numel, 0)
        self.grad = self.g.clone()
        self.k = k_for(numel, density)
        self.layout = (("w", numel),)
        self.residual = heavy_gradient(numel, 1).mul_(0.1)
        self.given = topk_indices(self.g + self.residual, self.k)  # what the leader's broadcast delivers

    def reset(self, memory: ResidualMemory) -> None:
        self.grad.copy_(self.g)
        memory.update(0, self.layout, self.residual, self.given[:0])


def before(bucket: Bucket, leader: bool) -> Timed:
    """The hook at d1e7473, op by op (see the module docstring)."""
    memory, workspace = ResidualMemory(), TopkWorkspace()
    k = bucket.k

    def run() -> torch.Tensor:
        a = memory.compensate(0, bucket.layout, bucket.grad)
        norm = float(torch.linalg.vector_norm(a, dtype=torch.float32))
        finite = math.isfinite(norm) or bool(torch.isfinite(a).all())
        indices = topk_indices(a, k, workspace) if leader else bucket.given
        values = a.index_select(0, indices)
        if not finite:
            values.fill_(float("nan"))
        float(torch.linalg.vector_norm(values, dtype=torch.float32))
        reduced = values  # stands in for the allreduce's result
        if bool(torch.isfinite(reduced).all()):
            memory.update(0, bucket.layout, a, indices)
        a.zero_()
        a[indices.long()] = reduced[:k].div_(WORLD)
        return a

    return lambda: bucket.reset(memory), run


def after_job(bucket: Bucket, policy: RoundRobin | None, rank: int) -> BucketJob:
    record = flexcomm.BucketRecord(step=0, bucket=0, numel=bucket.g.numel(), exchange="artopk", k=bucket.k, leader=0,
                                   t_compress=0.0, t_exchange=0.0, bytes_sent=0, gain=0.0)
    return BucketJob(grad=bucket.grad, accumulated=bucket.grad, index=0, layout=bucket.layout, k=bucket.k, step=0,
                     group=None, world_size=WORLD, rank=rank, memory=ResidualMemory(), workspace=TopkWorkspace(),
                     record=record, outcome=DeviceOutcome(), measured=lambda *_: None, selector=topk_indices, leaders=policy,
                     leader=0)


def accumulate(job: BucketJob, selects: bool) -> None:
    """The state's accumulation pass for the job (:meth:`flexcomm.FlexState.prepare`)."""
    job.accumulation = job.memory.accumulate(job.index, job.layout, job.grad, job.k if selects else None, job.workspace)
    job.accumulated = job.accumulation.a


def settle(job: BucketJob) -> None:
    """The step's one host read of the device-side outcome, then the residual's adoption."""
    to_host([job.outcome.gain, job.outcome.finite])
    job.memory.settle()


def after_artopk(bucket: Bucket, leader: bool) -> Timed:
    """Today's AR-Topk exchange code, its collectives left out."""
    job = after_job(bucket, RoundRobin(), rank=0 if leader else 1)

    def run() -> torch.Tensor:
        accumulate(job, selects=leader)
        # A follower's indices are what the broadcast would have delivered.
        indices = artopk.indices_to_broadcast(job) if leader else bucket.given
        values = artopk.contribution(job, indices)
        update = artopk.apply_update(job, indices, values)
        settle(job)
        return update

    return lambda: bucket.reset(job.memory), run


def after_agtopk(bucket: Bucket) -> Timed:
    """Today's AG-Topk exchange code, its allgather stood in for by this rank's message twice."""
    job = after_job(bucket, None, rank=0)

    def run() -> torch.Tensor:
        accumulate(job, selects=True)
        message, indices = allgather.contribution(job)
        update = allgather.apply_update(job, indices, torch.cat([message] * WORLD))
        settle(job)
        return update

    return lambda: bucket.reset(job.memory), run


def case_methods(bucket: Bucket) -> dict[str, Timed]:
    buf = torch.empty_like(bucket.g)
    return {
        "floor": (lambda: None, lambda: buf.copy_(bucket.g)),
        "before_leader": before(bucket, leader=True),
        "before_follower": before(bucket, leader=False),
        "after_leader": after_artopk(bucket, leader=True),
        "after_follower": after_artopk(bucket, leader=False),
        "after_agtopk": after_agtopk(bucket),
    }


def check_same_result(timed: dict[str, Timed]) -> None:
    """Before and after compute the same update, bit for bit, for the leader and the follower."""
    for role in ("leader", "follower"):
        outputs = []
        for name in (f"before_{role}", f"after_{role}"):
            setup, run = timed[name]
            setup()
            outputs.append(run().clone())
        assert torch.equal(outputs[0], outputs[1]), f"{role}: before and after differ"


def run_case(bucket: Bucket, repeats: int, progress: tqdm) -> dict[str, list[float]]:
    timed = case_methods(bucket)
    check_same_result(timed)  # also the warm-up (workspaces, residual buffers)
    times: dict[str, list[float]] = {name: [] for name in METHODS}
    for r in range(repeats):
        for name in METHODS[r % len(METHODS):] + METHODS[: r % len(METHODS)]:
            setup, run = timed[name]
            setup()
            started = time.thread_time()
            run()
            times[name].append((time.thread_time() - started) * 1e3)
        progress.update(1)
    return times


def peak_extra_copies(method: str, numel: int, density: float) -> float:
    """In a child process (see the module docstring): two steps of ``method``'s peak resident growth, in bucket copies."""
    warm_setup, warm_run = case_methods(Bucket(1 << 18, density))[method]
    warm_setup()
    warm_run()  # code pages and one-time buffers of the libraries are not the method's memory
    bucket = Bucket(numel, density)
    setup, run = case_methods(bucket)[method]
    Path("/proc/self/clear_refs").write_text("5")  # resets the peak-RSS mark
    before = proc_status_kib("VmRSS")
    for _ in range(2):
        setup()
        run()
    return (proc_status_kib("VmHWM") - before) * 1024 / (numel * bucket.g.element_size())


def measure_memory(numel: int, density: float) -> dict[str, float]:
    """Each method's :func:`peak_extra_copies`, each in a fresh child process."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "OMP_NUM_THREADS": "1"}
    out = {}
    for name in METHODS:
        child = subprocess.run([sys.executable, __file__, "--peak-memory", name, "--sizes", str(numel), "--densities", str(density)],
                               env=env, capture_output=True, text=True, check=True)
        out[name] = float(child.stdout.strip().splitlines()[-1])
    return out


def table(rows: list[dict], column: str, unit: str) -> str:
    shown = METHODS[1:]
    header = f"{'numel':>10} {'density':>7} {'floor ms':>9} " + " ".join(f"{m:>16}" for m in shown)
    lines = [header, "-" * len(header)]
    for numel, density in sorted({(r["numel"], r["density"]) for r in rows}):
        by = {r["method"]: r for r in rows if (r["numel"], r["density"]) == (numel, density)}
        lines.append(f"{numel:>10} {density:>7g} {by['floor']['median_ms']:>9.2f} "
                     + " ".join(f"{by[m][column]:>15.2f}{unit}" for m in shown))
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    cases = sorted({(r["numel"], r["density"]) for r in rows})
    fig, axes = figure(2, len(cases), figsize=(5.5 * len(cases), 7.6))
    shown = METHODS[1:]
    colors = ["tab:gray" if m.startswith("before") else "tab:blue" for m in shown]
    panels = (("copies", "median time / median copy", 3.0, "goal: 3 copies"),
              ("peak_extra_copies", "peak extra memory / bucket", 1.0, "goal: one copy"))
    for row, (column, label, goal, goal_label) in enumerate(panels):
        for ax, (numel, density) in zip(axes[row], cases):
            by = {r["method"]: r[column] for r in rows if (r["numel"], r["density"]) == (numel, density)}
            ax.bar(range(len(shown)), [by[m] for m in shown], color=colors)
            ax.axhline(goal, color="tab:green", ls=":", lw=1.2, label=goal_label)
            ax.set_xticks(range(len(shown)), [m.replace("_", "\n") for m in shown], fontsize=8)
            ax.set_ylabel(label)
            ax.set_title(f"{numel / 1e6:g}M float32, density {density:g}")
            ax.legend(fontsize=7)
    save(fig, path)


def main() -> None:
    parser = argument_parser(__doc__, quick="one size, 3 repeats", sizes="6.25e6,2.5e7", densities="0.01")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--peak-memory", metavar="METHOD", choices=METHODS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sizes = numbers(args.sizes, int)[:1] if args.quick else numbers(args.sizes, int)
    repeats = 3 if args.quick else args.repeats
    torch.set_num_threads(1)
    if args.peak_memory:
        print(peak_extra_copies(args.peak_memory, sizes[0], numbers(args.densities)[0]))
        return
    rows = []
    suffix = "_quick" if args.quick else ""
    cases = [(n, d) for n in sizes for d in numbers(args.densities)]
    with tqdm(total=len(cases) * repeats, unit="round", desc="local work") as progress:
        for numel, density in cases:
            times = run_case(Bucket(numel, density), repeats, progress)
            floor = median(times["floor"])
            memory = measure_memory(numel, density)
            rows += [{"numel": numel, "density": density, "method": name, "median_ms": round(median(times[name]), 4),
                      "min_ms": round(min(times[name]), 4), "copies": round(median(times[name]) / floor, 3),
                      "peak_extra_copies": round(memory[name], 3), "repeats": repeats}
                     for name in METHODS]
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(args.out_dir / f"local_work{suffix}.csv", rows)
    plot(rows, args.out_dir / f"local_work{suffix}.png")
    text = (f"command: {command_line()}\ntorch {torch.__version__}, 1 thread\n\n"
            f"time, in copies of the bucket (median / median floor):\n{table(rows, 'copies', 'x')}\n\n"
            f"peak extra memory, in copies of the bucket:\n{table(rows, 'peak_extra_copies', ' ')}\n")
    (args.out_dir / f"local_work{suffix}.txt").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
