"""Cluster simulator: DDP-like bucketing, scaling in N, and the two-level model."""

from __future__ import annotations

import csv
import importlib.util
from pathlib import Path

import pytest

from flexcomm.cost import GLOO_ALGORITHMS, TREE_ALGORITHMS, CostParams, LinkParams, allreduce_time
from flexcomm.sim import (
    MODEL_NUM_PARAMS,
    Topology,
    bucket_sizes,
    exchange_time,
    hierarchical_allreduce_time,
    step_comm_time,
    step_dense_time_hierarchical,
)

WORLD_SIZES = [2**i for i in range(1, 11)]
FIG5_LINK = LinkParams.from_bandwidth(5e-3, 1e9)  # 5 ms, 1 Gbit/s


def test_resnet50_buckets_like_ddp():
    # 25,557,032 fp32: first bucket 1 MiB = 262,144 elements, then 25 MiB = 6,553,600 each;
    # 25,557,032 - 262,144 - 3 * 6,553,600 = 5,634,088 left for the last bucket
    assert bucket_sizes(MODEL_NUM_PARAMS["resnet50"]) == [262_144, 6_553_600, 6_553_600, 6_553_600, 5_634_088]


@pytest.mark.parametrize("value_bytes", [2, 4])
@pytest.mark.parametrize("model", list(MODEL_NUM_PARAMS))
def test_buckets_cover_all_parameters(model, value_bytes):
    sizes = bucket_sizes(MODEL_NUM_PARAMS[model], value_bytes)
    assert sum(sizes) == MODEL_NUM_PARAMS[model]
    assert sizes[0] * value_bytes <= 1 << 20
    assert all(m * value_bytes <= 25 << 20 for m in sizes)


def test_step_time_is_sum_over_buckets():
    params = CostParams.uniform(FIG5_LINK)
    count = MODEL_NUM_PARAMS["alexnet"]
    for exchange in ("dense", "agtopk", "artopk"):
        expected = sum(exchange_time(exchange, m, 0.1, 16, params) for m in bucket_sizes(count))
        assert step_comm_time(count, 16, params, exchange, 0.1) == pytest.approx(expected, rel=1e-12)
    with pytest.raises(ValueError):
        exchange_time("powersgd", 1000, 0.1, 4, params)  # type: ignore[arg-type]


@pytest.mark.parametrize("model", list(MODEL_NUM_PARAMS))
def test_agtopk_grows_linearly_in_n(model):
    # ring allgather: every bucket costs (N-1)(alpha + m beta), so T(N) / T(2) = N - 1 exactly.
    params = CostParams.uniform(FIG5_LINK)
    count = MODEL_NUM_PARAMS[model]
    base = step_comm_time(count, 2, params, "agtopk", 0.1)
    for n in WORLD_SIZES:
        assert step_comm_time(count, n, params, "agtopk", 0.1) / base == pytest.approx(n - 1, rel=1e-12)


@pytest.mark.parametrize("model", list(MODEL_NUM_PARAMS))
def test_artopk_grows_logarithmically_in_tree_model(model):
    # tree allreduce 2L(alpha + m beta) and binomial broadcast L(alpha + m beta): every term is
    # proportional to L = ceil(log2 N), so T(N) / T(2) = L: 10 at N = 1024, vs 1023 for AG-Topk.
    params = CostParams.uniform(FIG5_LINK, TREE_ALGORITHMS)
    count = MODEL_NUM_PARAMS[model]
    base = step_comm_time(count, 2, params, "artopk", 0.1)
    for n in WORLD_SIZES:
        assert step_comm_time(count, n, params, "artopk", 0.1) / base == pytest.approx(n.bit_length() - 1, rel=1e-12)


def test_artopk_bandwidth_term_nearly_flat_with_gloo_ring():
    # alpha = 0 isolates the bandwidth terms; per bucket (k values, fp32):
    #   AR-Topk = k beta (2(N-1)/N * 4 + L * 4)    AG-Topk = k beta (N-1) * 8
    # N=1024 vs N=2: AR (2*1023/1024*4 + 10*4) / (1*4 + 1*4) = 47.9921875 / 8;  AG 1023x
    params = CostParams.uniform(LinkParams(0.0, 8e-9))
    count = MODEL_NUM_PARAMS["vit_b_16"]
    ar = step_comm_time(count, 1024, params, "artopk", 0.1) / step_comm_time(count, 2, params, "artopk", 0.1)
    ag = step_comm_time(count, 1024, params, "agtopk", 0.1) / step_comm_time(count, 2, params, "agtopk", 0.1)
    assert ar == pytest.approx(47.9921875 / 8, rel=1e-12)
    assert ag == pytest.approx(1023, rel=1e-12)


@pytest.mark.parametrize("algorithms", [GLOO_ALGORITHMS, TREE_ALGORITHMS])
def test_ag_over_ar_ratio_grows_with_n(algorithms):
    params = CostParams.uniform(FIG5_LINK, algorithms)
    for count in MODEL_NUM_PARAMS.values():
        ratios = [
            step_comm_time(count, n, params, "agtopk", 0.1) / step_comm_time(count, n, params, "artopk", 0.1)
            for n in (8, 64, 1024)
        ]
        assert ratios[0] < ratios[1] < ratios[2]
        assert ratios[2] > 3.0


# --------------------------------------------------------------------------- two-level model

INTRA = LinkParams(1e-5, 1e-10)
INTER = LinkParams(1e-4, 1e-9)


def test_hierarchical_allreduce_hand_value():
    # g=4 GPUs x n=2 nodes, m=1e6 bytes:
    # intra phases 2 * (3*1e-5 + 3/4*1e6*1e-10) = 2 * 1.05e-4 = 2.1e-4
    # inter ring allreduce of m/g = 2.5e5 bytes on 2 nodes: 2*1e-4 + 2*1/2*2.5e5*1e-9 = 4.5e-4
    topo = Topology(nodes=2, gpus_per_node=4, intra=INTRA, inter=INTER)
    assert hierarchical_allreduce_time(1e6, topo) == pytest.approx(6.6e-4, rel=1e-12)


def test_hierarchical_reduces_to_single_level():
    one_node = Topology(nodes=1, gpus_per_node=8, intra=INTRA, inter=INTER)
    one_gpu = Topology(nodes=8, gpus_per_node=1, intra=INTRA, inter=INTER)
    assert hierarchical_allreduce_time(1e6, one_node) == pytest.approx(allreduce_time(1e6, 8, INTRA), rel=1e-12)
    assert hierarchical_allreduce_time(1e6, one_gpu) == pytest.approx(allreduce_time(1e6, 8, INTER), rel=1e-12)


@pytest.mark.parametrize("model", list(MODEL_NUM_PARAMS))
def test_eight_gpus_per_node_beat_one_gpu_per_node(model):
    intra = Topology(nodes=1, gpus_per_node=8)
    inter = Topology(nodes=8, gpus_per_node=1)
    assert intra.world_size == inter.world_size == 8
    count = MODEL_NUM_PARAMS[model]
    assert step_dense_time_hierarchical(count, intra) < step_dense_time_hierarchical(count, inter)


def test_sim_figures_script_writes_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sim_figures.py"
    monkeypatch.syspath_prepend(str(path.parent))  # as when run as a script: its sibling common.py
    spec = importlib.util.spec_from_file_location("sim_figures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(["--out-dir", str(tmp_path)])
    for name in ("sim_fig5_comm_vs_n", "sim_fig1b_intra_vs_inter"):
        assert (tmp_path / f"{name}.png").stat().st_size > 0
    with (tmp_path / "sim_fig5_comm_vs_n.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 2 * 3 * 2 * 10  # algorithm sets x models x exchanges x N
    with (tmp_path / "sim_fig1b_intra_vs_inter.csv").open() as handle:
        assert len(list(csv.DictReader(handle))) == 3 * 2
