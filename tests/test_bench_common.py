"""Tests for benchmarks/common.py: the helpers every benchmark's numbers pass through (medians, fits, CSV)."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import common  # noqa: E402
import op_timing  # noqa: E402

from flexcomm.cost import CostParams, LinkParams, collective_time  # noqa: E402


def test_point_rows_take_the_median_and_an_exchange_s_communication_part() -> None:
    plan = [op_timing.plan_entry("allreduce", 4000, 0.01), op_timing.plan_entry("agtopk", 4000, 0.01, density=0.1)]
    raw = [{"entry": 0, "round": r, "times": [t]} for r, t in enumerate((3.0, 1.0, 1.5))]
    # exchange samples: [step wall, t_compress, t_compress + t_exchange]
    raw += [{"entry": 1, "round": r, "times": [w, c, c + x]}
            for r, (w, c, x) in enumerate(((9.0, 1.0, 4.0), (8.0, 2.0, 9.0), (1.0, 6.0, 5.0)))]
    collective, exchange = op_timing.point_rows("1gbit", 2, plan, raw)
    assert (collective["measured_s"], collective["min_s"], collective["compress_s"]) == (1.5, 1.0, 0.0)  # medians
    assert "density" not in collective
    assert (exchange["measured_s"], exchange["min_s"]) == (5.0, 4.0)
    assert (exchange["compress_s"], exchange["step_wall_s"], exchange["density"]) == (2.0, 8.0, 0.1)


def test_fit_collectives_recovers_the_alpha_and_beta_that_made_the_times() -> None:
    truth = CostParams(allreduce=LinkParams(2e-4, 8 / 900e6), allgather=LinkParams(3e-4, 8 / 600e6),
                       broadcast=LinkParams(1e-4, 8 / 950e6))
    rows = [{"kind": kind, "bytes": int(size), "measured_s": collective_time(kind, size, 4, truth)}
            for kind in common.COLLECTIVES for size in (1e3, 1e5, 1e6, 1e7)]
    fitted = op_timing.fit_collectives(rows, 4, "1gbit")
    for kind in common.COLLECTIVES:
        assert fitted.link(kind).alpha == pytest.approx(truth.link(kind).alpha, rel=0.01)
        assert fitted.link(kind).beta == pytest.approx(truth.link(kind).beta, rel=0.01)
    # only the sizes >= min_bytes count: one wrong small point no longer matters
    rows.append({"kind": "allreduce", "bytes": 100, "measured_s": 1.0})
    assert op_timing.fit_collectives(rows, 4, "1gbit", 1e3).allreduce.beta == pytest.approx(truth.allreduce.beta,
                                                                                         rel=0.01)


def test_make_plan_skips_ops_whose_nominal_time_exceeds_the_limit() -> None:
    plan, skipped = op_timing.make_plan("10mbit", 2, (1e3, 1e8), density=0.1, max_op_s=10.0)
    assert {(e["op"], e["bytes"]) for e in plan} == {(op, 1000) for op in (*common.COLLECTIVES, *common.EXCHANGES)}
    assert {e["bytes"] for e in skipped} == {100_000_000}
    assert all(e["bytes"] % (4 * 2) == 0 and e["reps"] >= 3 for e in plan)


def test_write_csv_unions_the_columns_and_formats_floats_on_request(tmp_path: Path) -> None:
    rows = [{"a": 1, "b": 0.123456789}, {"a": 2, "c": None}]
    common.write_csv(tmp_path / "full.csv", rows)
    common.write_csv(tmp_path / "short.csv", rows, float_format=".3g")
    full = list(csv.DictReader((tmp_path / "full.csv").open()))
    assert full == [{"a": "1", "b": "0.123456789", "c": ""}, {"a": "2", "b": "", "c": ""}]
    assert list(csv.DictReader((tmp_path / "short.csv").open()))[0]["b"] == "0.123"


def test_numbers_parses_comma_separated_options() -> None:
    assert common.numbers("1e6,8000000", int) == [1_000_000, 8_000_000]
    assert common.numbers("0.1,0.01") == [0.1, 0.01]


def test_gpu_check_skips_cleanly_without_a_gpu(capsys: pytest.CaptureFixture[str]) -> None:
    import gpu_check  # noqa: PLC0415 - imports torch.multiprocessing; only this test needs it

    if gpu_check.torch.cuda.is_available():
        pytest.skip("this machine has a GPU: run benchmarks/gpu_check.py itself")
    assert gpu_check.main([]) == 0
    assert "no CUDA device here; skipped" in capsys.readouterr().out
