"""Simulated figures from the alpha-beta cost model (no GPUs, no network needed).

    python benchmarks/sim_figures.py [--out-dir benchmarks/results]

Writes
* ``sim_fig5_comm_vs_n.{csv,png}``: per-step communication time vs N (2..1024) of AG-Topk
  and AR-Topk at density 0.1, alpha = 5 ms, 1 Gbit/s, for ResNet-50, AlexNet and ViT-B/16,
  under gloo's algorithms (ring allreduce/allgather, binomial broadcast) and under the paper
  authors' tree model (tree allreduce, recursive-doubling allgather);
* ``sim_fig1b_intra_vs_inter.{csv,png}``: dense allreduce latency per step, 8 GPUs in one
  node vs 8 nodes with 1 GPU each over 10 Gbit/s (link assumptions in flexcomm.sim.comm_time);
and prints the key ratios.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import common
from flexcomm.cost import GLOO_ALGORITHMS, TREE_ALGORITHMS, Algorithms, CostParams, LinkParams
from flexcomm.sim import MODEL_NUM_PARAMS, Topology, comm_vs_world_size, step_dense_time_hierarchical

WORLD_SIZES = [2**i for i in range(1, 11)]
ALGORITHM_SETS: dict[str, Algorithms] = {"gloo_ring": GLOO_ALGORITHMS, "paper_tree": TREE_ALGORITHMS}
SETUPS = {"8 GPUs/node": Topology(nodes=1, gpus_per_node=8), "1 GPU/node, 10 Gbps": Topology(nodes=8, gpus_per_node=1)}
RATIO_AT = (8, 64, 1024)


def fig5_rows(density: float, alpha: float, bits_per_second: float) -> list[dict[str, object]]:
    """AG-Topk and AR-Topk step times for every model, N and algorithm set."""
    link = LinkParams.from_bandwidth(alpha, bits_per_second)
    rows = []
    for label, algorithms in ALGORITHM_SETS.items():
        params = CostParams.uniform(link, algorithms)
        for row in comm_vs_world_size(MODEL_NUM_PARAMS, WORLD_SIZES, ("agtopk", "artopk"), density, params):
            meta = {"algorithms": label, "density": density, "alpha_s": alpha, "bandwidth_bps": bits_per_second}
            rows.append({**meta, **row})
    return rows


def fig1b_rows() -> list[dict[str, object]]:
    """Dense allreduce step time of every model on the intra-node and the inter-node setup."""
    return [
        {
            "model": name,
            "setup": setup,
            "nodes": topo.nodes,
            "gpus_per_node": topo.gpus_per_node,
            "seconds": step_dense_time_hierarchical(count, topo),
        }
        for name, count in MODEL_NUM_PARAMS.items()
        for setup, topo in SETUPS.items()
    ]


def _series(rows: Sequence[dict[str, object]], **match: object) -> list[float]:
    """``seconds`` of the rows matching ``match``, in row order."""
    return [float(r["seconds"]) for r in rows if all(r[k] == v for k, v in match.items())]


def plot_fig5(rows: Sequence[dict[str, object]], path: Path) -> None:
    """Communication time vs N, one panel per model, log-log axes."""
    fig, axes = common.figure(1, len(MODEL_NUM_PARAMS), figsize=(15, 4.2), sharey=True, squeeze=True)
    styles = {"gloo_ring": "-", "paper_tree": "--"}
    colors = {"agtopk": "tab:red", "artopk": "tab:blue"}
    for ax, model in zip(axes, MODEL_NUM_PARAMS):
        for label, style in styles.items():
            for exchange, color in colors.items():
                seconds = _series(rows, model=model, algorithms=label, exchange=exchange)
                ax.plot(WORLD_SIZES, seconds, style, color=color, marker="o", ms=3, label=f"{exchange} ({label})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{model} ({MODEL_NUM_PARAMS[model] / 1e6:.1f}M params)")
        ax.set_xlabel("workers N")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("communication time per step (s)")
    axes[0].legend(fontsize=8)
    first = rows[0]
    fig.suptitle(
        f"Simulated AG-Topk vs AR-Topk: density {first['density']}, alpha {float(first['alpha_s']) * 1e3:g} ms, "
        f"{float(first['bandwidth_bps']) / 1e9:g} Gbit/s, 25 MiB buckets"
    )
    common.save(fig, path)


def plot_fig1b(rows: Sequence[dict[str, object]], path: Path) -> None:
    """Grouped bars: dense allreduce per step, intra-node vs inter-node, per model."""
    fig, ax = common.figure(figsize=(7, 4), squeeze=True)
    width = 0.38
    for i, setup in enumerate(SETUPS):
        seconds = _series(rows, setup=setup)
        positions = [j + (i - 0.5) * width for j in range(len(MODEL_NUM_PARAMS))]
        ax.bar(positions, [s * 1e3 for s in seconds], width, label=setup)
    ax.set_xticks(range(len(MODEL_NUM_PARAMS)), list(MODEL_NUM_PARAMS))
    ax.set_ylabel("dense allreduce per step (ms)")
    ax.set_title("Simulated aggregation latency, 8 workers")
    ax.legend()
    ax.grid(True, axis="y", alpha=0.3)
    common.save(fig, path)


def print_ratios(fig5: Sequence[dict[str, object]], fig1b: Sequence[dict[str, object]]) -> None:
    """AG/AR time ratio at a few N, and inter-/intra-node ratio of dense allreduce."""
    print("AG-Topk / AR-Topk time ratio")
    print(f"{'model':<10} {'algorithms':<11} " + " ".join(f"{'N=' + str(n):>9}" for n in RATIO_AT))
    for model in MODEL_NUM_PARAMS:
        for label in ALGORITHM_SETS:
            cells = []
            for n in RATIO_AT:
                ag = _series(fig5, model=model, algorithms=label, exchange="agtopk", world_size=n)[0]
                ar = _series(fig5, model=model, algorithms=label, exchange="artopk", world_size=n)[0]
                cells.append(f"{ag / ar:9.2f}")
            print(f"{model:<10} {label:<11} " + " ".join(cells))
    intra_setup, inter_setup = SETUPS
    print("\nDense allreduce per step: 1 GPU/node over 10 Gbps vs 8 GPUs/node")
    for model in MODEL_NUM_PARAMS:
        intra = _series(fig1b, model=model, setup=intra_setup)[0]
        inter = _series(fig1b, model=model, setup=inter_setup)[0]
        print(f"{model:<10} intra {intra * 1e3:8.1f} ms  inter {inter * 1e3:8.1f} ms  ratio {inter / intra:6.2f}")


def main(argv: Sequence[str] | None = None) -> None:
    """Parse arguments, write both figures' CSV and PNG, print the ratio table."""
    parser = common.argument_parser(__doc__)
    parser.add_argument("--density", type=float, default=0.1, help="fraction of elements kept (CR)")
    parser.add_argument("--alpha", type=float, default=5e-3, help="latency per message in seconds")
    parser.add_argument("--bandwidth-gbps", type=float, default=1.0)
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)

    fig5 = fig5_rows(args.density, args.alpha, args.bandwidth_gbps * 1e9)
    common.write_csv(args.out_dir / "sim_fig5_comm_vs_n.csv", fig5)
    plot_fig5(fig5, args.out_dir / "sim_fig5_comm_vs_n.png")
    fig1b = fig1b_rows()
    common.write_csv(args.out_dir / "sim_fig1b_intra_vs_inter.csv", fig1b)
    plot_fig1b(fig1b, args.out_dir / "sim_fig1b_intra_vs_inter.png")
    print_ratios(fig5, fig1b)
    print(f"\nwrote {args.out_dir}/sim_fig5_comm_vs_n.{{csv,png}} and sim_fig1b_intra_vs_inter.{{csv,png}}")


if __name__ == "__main__":
    main()
