"""What flex's probe costs, and how well its fit predicts a dense allreduce, with and without cut sizes.

    python benchmarks/probe_cost.py [--links 1gbit,100mbit,20mbit] [--rounds 3]

Per link (2 emulated hosts, :class:`flexcomm.netem.EmulatedCluster`), rounds alternate the probe as
flexcomm runs it (``probe_collectives`` with the default sizes, 64 KiB and 1 MiB, the larger cut
to ~25 ms of transfer by the smaller message: :func:`flexcomm.cost.probe_size`) and the same probe
with every size timed as configured (the behaviour before the cut).  Each probe's observations
are fitted alone (a fresh :class:`flexcomm.cost.CostEstimator`), and the fit's prediction of a
dense fp32 / fp16 allreduce of the demo's MLP (669,706 parameters) is compared with that
allreduce's measured time (the fastest of three).  Reported per link and mode: the probe's wall
time and the prediction's relative error (median over rounds).

Writes ``probe_cost.csv`` (one row per probe) and ``probe_cost.png`` to ``--out-dir``.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist

from common import (argument_parser, figure, finish_worker, init_worker, main_or_worker, network, numbers, run_job, save,
                    write_csv)
from flexcomm.comm import allreduce_floats, probes
from flexcomm.cost import CostEstimator, collective_time

MODES = ("cut", "uncut")
DEFAULT_SIZES = (65536, 1 << 20)
#: Dense allreduces of the demo's MLP: fp32 and fp16 (dense16) bytes.
TARGETS = {"dense": 669_706 * 4, "dense16": 669_706 * 2}


# ============================================================================ worker side
def _probe(mode: str) -> tuple[float, list[Any]]:
    """One probe as flexcomm runs it (``cut``) or with every size as configured (``uncut``)."""
    cut = probes.probe_size
    if mode == "uncut":
        probes.probe_size = lambda size, last, latency: size
    try:
        started = perf_counter()
        observations = probes.probe_collectives(DEFAULT_SIZES, None)
        return perf_counter() - started, observations
    finally:
        probes.probe_size = cut


def timed_allreduce(nbytes: int) -> float:
    """Seconds of one allreduce of ``nbytes``, the ranks lined up first (as a probe times it)."""
    payload = torch.zeros(nbytes // 4)
    dist.all_reduce(torch.zeros(1))
    started = perf_counter()
    dist.all_reduce(payload)
    return perf_counter() - started


def worker(cfg: dict[str, Any]) -> None:
    _, world = init_worker()
    rows = []
    for round_ in range(cfg["rounds"]):
        for mode in MODES:
            seconds, observations = _probe(mode)
            estimator = CostEstimator(forgetting=0.9)
            estimator.observe_all(observations)
            predicted = {name: collective_time("allreduce", nbytes, world, estimator.params) for name, nbytes in TARGETS.items()}
            rows.append({"round": round_, "mode": mode, "probe_s": seconds,
                         "sizes": [obs.nbytes for obs in observations[len(observations) // 2:]],
                         **{f"predicted_{name}_s": t for name, t in predicted.items()}})
    # The allreduces' measured time: the fastest of three, the max over ranks (probes' own timing).
    measured = {name: min(timed_allreduce(nbytes) for _ in range(3)) for name, nbytes in TARGETS.items()}
    merged = dict(zip(measured, allreduce_floats(list(measured.values()), None, dist.ReduceOp.MAX)))
    finish_worker(cfg, {"rows": rows, "measured": merged})


# ============================================================================ launcher side
def link_rows(link: str, result: dict[str, Any]) -> list[dict[str, Any]]:
    measured = result["measured"]
    return [{"link": link, **{k: v for k, v in row.items() if k != "sizes"},
             "large_sizes": " ".join(str(n) for n in row["sizes"]),
             **{f"measured_{name}_s": measured[name] for name in TARGETS},
             **{f"error_{name}": abs(row[f"predicted_{name}_s"] - measured[name]) / measured[name] for name in TARGETS}}
            for row in result["rows"]]


def summary(rows: Sequence[dict[str, Any]], links: Sequence[str]) -> list[dict[str, Any]]:
    out = []
    for link in links:
        for mode in MODES:
            mine = [r for r in rows if r["link"] == link and r["mode"] == mode]
            out.append({"link": link, "mode": mode, "probe_s": statistics.median(r["probe_s"] for r in mine),
                        **{f"error_{name}": statistics.median(r[f"error_{name}"] for r in mine) for name in TARGETS}})
    return out


def plot(table: Sequence[dict[str, Any]], links: Sequence[str], path: Any) -> None:
    fig, axes = figure(1, 2, figsize=(10, 4))
    width = 0.38
    for i, mode in enumerate(MODES):
        mine = {r["link"]: r for r in table if r["mode"] == mode}
        xs = [j + (i - 0.5) * width for j in range(len(links))]
        axes[0][0].bar(xs, [mine[link]["probe_s"] for link in links], width, label=mode)
        axes[0][1].bar(xs, [100 * mine[link]["error_dense"] for link in links], width, label=mode)
    for ax, ylabel in zip(axes[0], ("probe wall time (s), median", "|predicted - measured| / measured (%), dense allreduce")):
        ax.set_xticks(range(len(links)), links)
        ax.set(ylabel=ylabel)
        ax.grid(alpha=0.3, axis="y")
        ax.legend()
    save(fig, path)


def main() -> int:
    ap = argument_parser(__doc__, links="1gbit,100mbit,20mbit")
    ap.add_argument("--rounds", type=int, default=3, help="probes per mode and link")
    args = ap.parse_args()
    links = numbers(args.links, str)
    rows: list[dict[str, Any]] = []
    for link in links:
        with network(link, 2, "fpc") as cluster:
            rows += link_rows(link, run_job(__file__, cluster, 2, {"rounds": args.rounds}, total=None, desc=link, timeout=900))
    args.out_dir.mkdir(parents=True, exist_ok=True)
    write_csv(args.out_dir / "probe_cost.csv", rows)
    table = summary(rows, links)
    plot(table, links, args.out_dir / "probe_cost.png")
    for r in table:
        print(f"{r['link']:>8} {r['mode']:>5}: probe {r['probe_s'] * 1e3:6.0f} ms, dense allreduce predicted within "
              f"{100 * r['error_dense']:.0f}% (dense16 {100 * r['error_dense16']:.0f}%)")
    return 0


if __name__ == "__main__":
    main_or_worker(main, worker)
