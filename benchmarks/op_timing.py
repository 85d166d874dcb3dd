"""The op-timing job: time a plan of collectives and exchanges on N ranks, and fit (alpha, beta) to it.

Run by ``collectives.py``, ``sim_check.py``, ``switching.py`` and ``adaptivity.py``
(:func:`time_plan_worker` is their worker).  A plan is a list of entries
``{"op", "bytes", "reps", "warmup"[, "density"]}``: the collectives ``allreduce``,
``allgather`` (size = each rank's contribution) and ``broadcast`` from preallocated float32
buffers, and the exchanges ``dense``, ``agtopk``, ``artopk`` through the real hook (DDP over
one :class:`common.GradientInjector` parameter of the message size).  Rounds interleave the
entries so slow phases of the shared machine hit all alike; every time is the max over ranks
(:func:`common.aligned_seconds`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

import flexcomm
from common import (COLLECTIVES, COMPRESSOR_OF, EXCHANGES, aligned_seconds, finish_worker, hooked_ddp, init_worker,
                    max_over_ranks, median, network, nominal_params, nominal_seconds, progress, rank_gradient,
                    run_job, train_step)
from flexcomm.cost import AlphaBetaEstimator, CostParams, LinkParams
from flexcomm.netem import parse_rate


def reps_for(seconds: float) -> int:
    """Repeats per point: many for fast ops (noisy), three for slow ones."""
    if seconds < 0.05:
        return 15
    if seconds < 0.5:
        return 5
    return 3


def plan_entry(op: str, nbytes: int, est_s: float, **extra: Any) -> dict[str, Any]:
    """One entry of an op-timing plan: repeats and warm-up follow from its nominal time."""
    return {"op": op, "bytes": nbytes, **extra, "est_s": est_s, "reps": reps_for(est_s), "warmup": est_s < 2.0}


def make_plan(rate: str, n: int, sizes: Sequence[float], density: float, max_op_s: float,
              ops: Sequence[str] = (*COLLECTIVES, *EXCHANGES)) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The entries of one job (every op at every size), and the skipped ones (nominal time > ``max_op_s``)."""
    params = nominal_params(rate)
    plan, skipped = [], []
    for size in sizes:
        nbytes = int(round(size / (4 * n))) * 4 * n  # whole floats, divisible among ranks
        for op in ops:
            entry = plan_entry(op, nbytes, nominal_seconds(op, nbytes, n, params, density))
            (skipped if entry["est_s"] > max_op_s else plan).append(entry)
    return plan, skipped


def plan_seconds(plan: Sequence[dict[str, Any]]) -> float:
    return sum(e["est_s"] * (e["reps"] + e["warmup"]) for e in plan)


def _collective_op(kind: str, nbytes: int, buf: torch.Tensor, out: torch.Tensor, world: int) -> Callable[[], Any]:
    numel = max(1, nbytes // 4)
    payload = buf[:numel]
    if kind == "allreduce":
        return lambda: dist.all_reduce(payload)
    if kind == "allgather":
        gathered = out[: numel * world]
        gather_into = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather_into(gathered, payload)
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


def time_plan_worker(cfg: dict[str, Any]) -> None:
    """One rank of the op-timing job: time everything in ``cfg['plan']``, max over ranks.

    Result: ``[{"entry", "round", "times"}]``; a collective's times are ``[t]``, an
    exchange's ``[step wall, t_compress, t_compress + t_exchange]`` (each the max over ranks).
    """
    _, world = init_worker()
    plan = cfg["plan"]
    samples = _time_collectives(plan, world) + _time_exchanges(plan, cfg["density"])
    flat = [t for _, _, ts in samples for t in ts]
    merged = iter(max_over_ranks(flat))
    result = [{"entry": i, "round": rnd, "times": [next(merged) for _ in ts]} for i, rnd, ts in samples]
    finish_worker(cfg, result)


def run_plan(script: str, rate: str, n: int, plan: list[dict[str, Any]], density: float, prefix: str
             ) -> list[dict[str, Any]]:
    """Run the op-timing job of ``plan`` (``script``'s worker is :func:`time_plan_worker`) at ``rate`` on ``n`` ranks."""
    with network(rate, n, prefix) as cluster:
        return run_job(script, cluster, n, {"plan": plan, "density": density}, total=sum(e["reps"] for e in plan),
                       desc=f"{rate} N={n}", timeout=3 * plan_seconds(plan) + 600)


def point_rows(rate: str, n: int, plan: list[dict[str, Any]], raw: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per plan entry: the median over its repeats of the op-timing job's (max-over-ranks) times.

    ``measured_s`` is a collective's time, or an exchange's communication time
    ``max_r(t_compress + t_exchange) - max_r(t_compress)``: the span from the hook receiving
    the bucket to the averaged result, less the top-k selection on the critical path.
    """
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
        own_density = {"density": e["density"]} if "density" in e else {}
        rows.append({"rate": rate, "world_size": n, "kind": e["op"], "bytes": e["bytes"], **own_density,
                     "reps": len(samples), "measured_s": median(values), "min_s": min(values), "compress_s": comp,
                     "step_wall_s": wall})
    return rows


def fit_kind(kind: str, points: Sequence[tuple[int, float]], n: int, rate_bps: float) -> LinkParams:
    """Least-squares (alpha, beta) of one collective kind over ``(bytes, median seconds)``."""
    est = AlphaBetaEstimator(kind, forgetting=1.0, prior=LinkParams.from_bandwidth(1e-4, rate_bps),
                             prior_weight=1e-6, prior_floor=1e-9)  # type: ignore[arg-type]
    for nbytes, seconds in points:
        est.observe(nbytes, n, seconds)
    return est.params


def fit_collectives(rows: Sequence[dict[str, Any]], n: int, rate: str, min_bytes: float = 0.0) -> CostParams:
    """(alpha, beta) per collective kind over the :func:`point_rows` medians of at least ``min_bytes``."""
    fits = {kind: fit_kind(kind, [(r["bytes"], r["measured_s"]) for r in rows
                                  if r["kind"] == kind and r["bytes"] >= min_bytes], n, parse_rate(rate))
            for kind in COLLECTIVES}
    return CostParams(fits["allreduce"], fits["allgather"], fits["broadcast"])
