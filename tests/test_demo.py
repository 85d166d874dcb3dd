"""flexcomm-demo: two real runs side by side, the table, the plots, and the loopback fallback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexcomm.train import demo
from flexcomm.train.records import final_accuracy

TINY = ["--", "--dataset", "synthetic", "--train-subset", "256", "--test-subset", "64", "--threads", "1"]


def test_demo_without_emulation_runs_both_on_loopback_and_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(demo, "netem_available", lambda: (False, "needs root"))
    demo.main(["--steps", "6", "--target-acc", "0.01", "--out", str(tmp_path), *TINY])
    printed = capfd.readouterr().out
    assert "network emulation unavailable (needs root); running on plain loopback" in printed
    for run, compressor, density in (("dense", "dense", 1.0), ("powersgd", "powersgd", None), ("flexcomm", "flex", "auto")):
        config = json.loads((tmp_path / run / "config.json").read_text())
        assert (config["compressor"], config["density"], config["net"], config["steps"]) == (compressor, density, "none", 6)
        assert (config["model"], config["test_subset"]) == ("mlp", 64)  # the options after -- come last and win
        assert config["bucket_cap_mb"] == "one" and json.loads((tmp_path / run / "summary.json").read_text())["buckets"] == 1
    assert config["powersgd_rank"] is None
    assert json.loads((tmp_path / "powersgd" / "config.json").read_text())["powersgd_rank"] == 4
    assert "time to 1.0% accuracy" in printed and "dense DDP" in printed and "PowerSGD r4" in printed
    assert "flexcomm's final accuracy is" in printed
    assert f"plot: {tmp_path / 'accuracy.png'}" in printed and (tmp_path / "accuracy.png").stat().st_size > 0


def test_final_accuracy_averages_the_last_evaluations_on_its_grid() -> None:
    # Evaluated every 5 steps: the final accuracy spans the run's end (after steps 250, 275 and 300
    # of 300; 260, 285 and 310 of 310), not its last 10 steps.
    records = [{"step": s, **({"accuracy": s / 1000} if (s + 1) % 5 == 0 or s == 309 else {})} for s in range(310)]
    assert final_accuracy(records[:300], 25) == pytest.approx((0.249 + 0.274 + 0.299) / 3)
    assert final_accuracy(records, 25) == pytest.approx((0.259 + 0.284 + 0.309) / 3)
    assert final_accuracy(records[:300]) == pytest.approx((0.289 + 0.294 + 0.299) / 3)
    assert final_accuracy(records[:40], 25) == pytest.approx((0.029 + 0.034 + 0.039) / 3)  # too few on the grid
    assert final_accuracy([{"step": 0}], 25) is None


def test_table_compares_with_the_first_run() -> None:
    run = {"final_accuracy_mean": 0.8, "total_bytes": 2_000_000, "mean_step_time": 0.25, "train_time": 50.0}
    table = demo.format_table(
        {"dense DDP": {**run, "time_to_target": 40.0}, "flexcomm": {**run, "time_to_target": 10.0},
         "slow": {**run, "time_to_target": None}},
        0.75,
    )
    lines = table.splitlines()
    assert lines[1].split()[-7:] == ["40.0", "s", "10.0", "s", "(4.0x)", "not", "reached"]
    assert "time to 75.0% accuracy" in lines[1] and "2.0 MB" in lines[3] and "250 ms" in lines[4]


def test_verdict_says_where_flexcomm_did_not_win() -> None:
    results = {
        "dense DDP": {"time_to_target": 40.0, "final_accuracy_mean": 0.80},
        "PowerSGD r4": {"time_to_target": 8.0, "final_accuracy_mean": 0.79},
        "flexcomm": {"time_to_target": 10.0, "final_accuracy_mean": 0.785},
    }
    lines = demo.verdict(results, "flexcomm").splitlines()
    assert lines[0] == "flexcomm reached the target 4.0x faster than dense DDP (10.0 s vs 40.0 s)."
    assert lines[1] == "flexcomm was SLOWER to the target than PowerSGD r4: 10.0 s vs 8.0 s (1.25x)."
    assert lines[2] == "flexcomm's final accuracy is -1.5 points vs dense DDP's (MORE than 1 point below it)."
