"""Compression overhead on one CPU thread (paper Fig. 2), measured against one memory pass.

    python benchmarks/compress_overhead.py [--sizes 1e6,1e7,2.5e7] [--densities 0.001,0.01,0.1]
                                           [--repeats N] [--quick] [--out-dir benchmarks/results]

For every gradient size, density and value distribution (``heavy``: standard normal times
a log-normal scale ``exp(N(0, 1))``, a heavy-tailed scale mixture like real gradients;
``normal``: plain standard normal), all in float32, the same run times:

``floor``            one memory pass: ``buf.copy_(x)`` into a preallocated buffer
``torch_topk``       ``torch.topk(x.abs(), k, sorted=False)``
``flexcomm_topk``    flexcomm's exact selection ``topk_indices(x, k, workspace)`` (the
                     AG-Topk and AR-Topk index-source selection), workspace reused
``mstopk``           ``mstopk_indices(x, k, rounds=20)``
``gather``           ``x.index_select(0, idx)`` for given indices (AR-Topk non-leader)
``agtopk_rank``      AG-Topk per-rank cost as the hook pays it: norm + select + gather + pack
``artopk_leader``    AR-Topk index-source rank: norm + select + gather
``artopk_nonleader`` AR-Topk other ranks: norm + gather
``mstopk_rank``      MSTopk per-rank cost: norm + select + gather + pack

The per-rank costs call the hook's own helpers (norm/finiteness, gathered values, gain,
padding and packing), so they track what :func:`flexcomm.hook` does between receiving a
bucket and launching its collective (error-feedback compensation, a separate pass
common to all compressors, is not included).

Timing: one warm-up call per method (allocations, workspace), then ``--repeats`` rounds;
in each round every method runs once, in an order rotated from round to round, so slow
phases of a shared machine hit all methods alike.  Reported: median and minimum, and
their ratios to the floor's median and minimum of the same case.

Checks, per case: ``topk_indices`` selects the same magnitudes as ``torch.topk`` and the
same index set except for elements tied with the k-th magnitude (at 25M float32 values
such ties occur: a float32 ulp near the threshold holds ~0.2-0.6 values on average).

Writes ``compress_overhead.csv``, ``compress_overhead.png`` and ``compress_overhead.txt``
(the printed table) under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from common import write_csv  # noqa: E402
from tqdm import tqdm  # noqa: E402

from flexcomm.compress import TopkWorkspace, k_for, mstopk_indices, pack, topk_indices  # noqa: E402
from flexcomm.compress.stats import contributed_values, gain, norm_and_finiteness  # noqa: E402

DEFAULT_SIZES = "1e6,1e7,2.5e7"
QUICK_SIZES = "1e6,1e7"
DEFAULT_DENSITIES = "0.001,0.01,0.1"
DISTRIBUTIONS = ("heavy", "normal")
MSTOPK_ROUNDS = 20
METHODS = (
    "floor",
    "torch_topk",
    "flexcomm_topk",
    "mstopk",
    "gather",
    "agtopk_rank",
    "artopk_leader",
    "artopk_nonleader",
    "mstopk_rank",
)
STYLES = {
    "torch_topk": ("tab:gray", "o", "-"),
    "flexcomm_topk": ("tab:blue", "o", "-"),
    "mstopk": ("tab:red", "o", "-"),
    "gather": ("tab:green", "s", "-"),
    "agtopk_rank": ("tab:blue", "^", ":"),
    "artopk_leader": ("tab:purple", "^", ":"),
    "artopk_nonleader": ("tab:green", "^", ":"),
    "mstopk_rank": ("tab:red", "^", ":"),
}


def make_gradient(numel: int, distribution: str, seed: int = 0) -> torch.Tensor:
    """Float32 test data: ``normal`` or ``heavy`` (normal times a log-normal scale)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(numel, generator=gen)
    if distribution == "heavy":
        x.mul_(torch.randn(numel, generator=gen).exp_())
    elif distribution != "normal":
        raise ValueError(f"unknown distribution {distribution!r}")
    return x


def check_exact(x: torch.Tensor, k: int, got: torch.Tensor) -> int:
    """Assert ``got`` is an exact top-k of ``|x|``; return how many indices differ from torch.topk's (ties)."""
    magnitude = x.abs()
    reference = torch.topk(magnitude, k, sorted=False)
    assert got.dtype == torch.int32 and got.numel() == k, (got.dtype, got.numel(), k)
    assert torch.equal(magnitude[got.long()].sort().values, reference.values.sort().values), "selected magnitudes differ"
    got_set, ref_set = set(got.tolist()), set(reference.indices.tolist())
    assert len(got_set) == k, "duplicate indices"
    differing = got_set ^ ref_set
    if differing:
        kth = float(reference.values.min())
        assert all(float(magnitude[i]) == kth for i in differing), "index sets differ beyond ties"
    return len(differing) // 2


def case_methods(x: torch.Tensor, k: int) -> dict[str, Callable[[], object]]:
    """The timed callables of one case; they share a workspace, buffers and AR-Topk's indices."""
    buf = torch.empty_like(x)
    workspace = TopkWorkspace()  # one per bucket in the hook, reused across steps
    given = topk_indices(x, k, TopkWorkspace())  # the indices a non-leader receives

    def values_at(indices: torch.Tensor) -> torch.Tensor:
        """A rank's contribution at ``indices`` (NaN everywhere if its gradient is not finite), its gain computed."""
        norm, finite = norm_and_finiteness(x)
        values = contributed_values(x, indices, finite)
        gain(values, norm)
        return values

    def packed_at(indices: torch.Tensor) -> torch.Tensor:
        """The allgather exchange's message: values and indices, padded to k."""
        values = values_at(indices)
        padding = k - indices.numel()
        return pack(torch.cat([values, values.new_zeros(padding)]), torch.cat([indices, indices.new_zeros(padding)]))

    return {
        "floor": lambda: buf.copy_(x),
        "torch_topk": lambda: torch.topk(x.abs(), k, sorted=False),
        "flexcomm_topk": lambda: topk_indices(x, k, workspace),
        "mstopk": lambda: mstopk_indices(x, k, MSTOPK_ROUNDS),
        "gather": lambda: x.index_select(0, given),
        "agtopk_rank": lambda: packed_at(topk_indices(x, k, workspace)),
        "artopk_leader": lambda: values_at(topk_indices(x, k, workspace)),
        "artopk_nonleader": lambda: values_at(given),
        "mstopk_rank": lambda: packed_at(mstopk_indices(x, k, MSTOPK_ROUNDS)),
    }


def run_case(x: torch.Tensor, k: int, repeats: int, progress: tqdm) -> tuple[dict[str, list[float]], int]:
    """Times (ms) of every method over ``repeats`` interleaved rounds, and the tie count of the check."""
    methods = case_methods(x, k)
    ties = check_exact(x, k, methods["flexcomm_topk"]())  # also the warm-up of the workspace
    for name, fn in methods.items():
        if name != "flexcomm_topk":
            fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(repeats):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            started = time.perf_counter()
            out = methods[name]()
            times[name].append((time.perf_counter() - started) * 1e3)
            if name == "flexcomm_topk" and r == repeats - 1:
                check_exact(x, k, out)  # the timed output itself, with the reused workspace
        progress.update(1)
    return times, ties


def summarise(times: dict[str, list[float]], meta: dict[str, object]) -> list[dict[str, object]]:
    floor_median = statistics.median(times["floor"])
    floor_min = min(times["floor"])
    rows = []
    for name in METHODS:
        median, minimum = statistics.median(times[name]), min(times[name])
        rows.append(
            {
                **meta,
                "method": name,
                "median_ms": round(median, 4),
                "min_ms": round(minimum, 4),
                "ratio_median": round(median / floor_median, 3),
                "ratio_min": round(minimum / floor_min, 3),
                "repeats": len(times[name]),
            }
        )
    return rows


def ratio_table(rows: Sequence[dict[str, object]]) -> str:
    """Median time / median floor, one line per distribution/size/density, one column per method."""
    shown = [m for m in METHODS if m != "floor"]
    header = f"{'dist':<7} {'numel':>9} {'density':>7} {'floor ms':>9} " + " ".join(f"{m:>16}" for m in shown)
    lines = [header, "-" * len(header)]
    cases = sorted({(r["distribution"], r["numel"], r["density"]) for r in rows}, key=lambda c: (DISTRIBUTIONS.index(c[0]), c[1], c[2]))
    for dist, numel, density in cases:
        by_method = {r["method"]: r for r in rows if (r["distribution"], r["numel"], r["density"]) == (dist, numel, density)}
        cells = " ".join(f"{by_method[m]['ratio_median']:>15.2f}x" for m in shown)
        lines.append(f"{dist:<7} {numel:>9} {density:>7g} {by_method['floor']['median_ms']:>9.2f} {cells}")
    return "\n".join(lines)


def plot(rows: Sequence[dict[str, object]], sizes: Sequence[int], densities: Sequence[float], path: Path) -> None:
    """Median time per method vs density (log-log), one panel per size and distribution; floor as a dashed line."""
    fig, axes = plt.subplots(len(DISTRIBUTIONS), len(sizes), figsize=(5.2 * len(sizes), 4.2 * len(DISTRIBUTIONS)), squeeze=False)
    for i, dist in enumerate(DISTRIBUTIONS):
        for j, numel in enumerate(sizes):
            ax = axes[i][j]

            def series(method: str) -> list[float]:
                found = {r["density"]: float(r["median_ms"]) for r in rows if (r["distribution"], r["numel"], r["method"]) == (dist, numel, method)}
                return [found[d] for d in densities]

            floor = series("floor")
            ax.plot(densities, floor, "--", color="black", lw=1.5, label="floor: one memory pass (copy)")
            ax.fill_between(densities, floor, [5 * f for f in floor], color="tab:green", alpha=0.08, label="within 5x of the floor")
            for method, (color, marker, style) in STYLES.items():
                ax.plot(densities, series(method), style, color=color, marker=marker, ms=5, label=method)
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xticks(list(densities), [f"{d:g}" for d in densities])
            ax.set_title(f"{numel / 1e6:g}M float32, {dist}")
            ax.set_xlabel("density k/n")
            ax.grid(True, which="both", alpha=0.3)
        axes[i][0].set_ylabel("time per call, one thread (ms)")
    axes[0][0].legend(fontsize=7, loc="upper left")
    fig.suptitle("Compression overhead vs one memory pass (median of interleaved repeats, torch.set_num_threads(1))")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_list(text: str, kind: type) -> list:
    return [kind(float(v)) if kind is int else kind(v) for v in text.split(",") if v.strip()]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default=None, help=f"comma-separated element counts (default {DEFAULT_SIZES}; --quick: {QUICK_SIZES})")
    parser.add_argument("--densities", default=DEFAULT_DENSITIES, help="comma-separated fractions kept")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds per case (default 7; --quick: 3)")
    parser.add_argument("--quick", action="store_true", help="fewer repeats and no 25M case (unless --sizes says so)")
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    sizes = parse_list(args.sizes or (QUICK_SIZES if args.quick else DEFAULT_SIZES), int)
    densities = sorted(parse_list(args.densities, float))
    repeats = args.repeats or (3 if args.quick else 7)
    if repeats < 1:
        parser.error("--repeats must be >= 1")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)

    command = "python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(sys.argv[1:] if argv is None else argv)])
    environment = (
        f"torch {torch.__version__}, numpy {np.__version__}, threads {torch.get_num_threads()}, "
        f"{platform.processor() or platform.machine()}, python {platform.python_version()}"
    )
    rows: list[dict[str, object]] = []
    tie_notes: list[str] = []
    cases = [(d, n, p) for d in DISTRIBUTIONS for n in sizes for p in densities]
    with tqdm(total=len(cases) * repeats, unit="round", desc="compress overhead") as progress:
        for dist in DISTRIBUTIONS:
            for numel in sizes:
                x = make_gradient(numel, dist)
                for density in densities:
                    k = k_for(numel, density)
                    progress.set_postfix_str(f"{dist} n={numel:.3g} d={density:g}")
                    times, ties = run_case(x, k, repeats, progress)
                    if ties:
                        tie_notes.append(f"{dist} n={numel} d={density:g}: {ties} index(es) swapped among ties at the k-th magnitude")
                    meta = {"distribution": dist, "numel": numel, "density": density, "k": k}
                    rows.extend(summarise(times, meta))
                del x

    write_csv(args.out_dir / "compress_overhead.csv", rows)
    plot(rows, sizes, densities, args.out_dir / "compress_overhead.png")
    report = [
        f"command: {command}",
        f"environment: {environment}",
        f"repeats: {repeats} interleaved rounds per case; ratio = median time / median floor (CSV also has min / min)",
        "",
        ratio_table(rows),
        "",
        "topk_indices exactness: same magnitudes as torch.topk in every case; "
        + ("index sets identical in every case." if not tie_notes else "index sets identical except ties: " + "; ".join(tie_notes)),
    ]
    text = "\n".join(report)
    print(text)
    (args.out_dir / "compress_overhead.txt").write_text(text + "\n")
    print(f"\nwrote {args.out_dir}/compress_overhead.{{csv,png,txt}}")


if __name__ == "__main__":
    main()
