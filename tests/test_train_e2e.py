"""A real, tiny flexcomm-train run (2 gloo ranks on loopback), its report, and the launcher's failure handling."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flexcomm.train import cli, report
from flexcomm.train.config import TrainConfig
from flexcomm.launch import RankFailed, RankProcess, supervise
from flexcomm.train.job import explain_failure, run_job
from flexcomm.train.rank_files import error_file

TINY = [
    "--dataset", "synthetic", "--train-subset", "512", "--test-subset", "128", "--model", "alexnet",
    "--width", "0.05", "--steps", "10", "--eval-every", "5", "--net", "none", "--threads", "1",
]
STEP_FIELDS = {
    "step", "epoch", "wall", "train_wall", "loss", "t_step", "t_compute", "t_wait", "t_compress", "t_sync", "t_optim",
    "bytes", "density", "exchanges", "leaders", "gain", "finite",
}


def test_tiny_run_and_report(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    cli.main([*TINY, "--out", str(run)])  # in-process: the ranks are real subprocesses all the same
    printed = capfd.readouterr().out  # file-descriptor level: rank 0 prints too
    assert "71,657 parameters" in printed
    assert f"records in {run / 'records.jsonl'}" in printed and "report: " in printed

    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(10))
    for r in records:
        assert STEP_FIELDS <= set(r)
        assert r["exchanges"] == ["artopk"] and r["leaders"] == [r["step"] % 2]
        assert r["bytes"] > 0 and 0 < r["density"] < 0.02 and r["t_step"] >= r["t_compute"] > 0
    assert [r["step"] for r in records if "accuracy" in r] == [4, 9]
    # Evaluation is wall time, not training time (the clock of an emulated link's schedule).
    evaluated = [r["wall"] - r["train_wall"] for r in records]
    assert evaluated[:4] == [pytest.approx(0.0, abs=1e-9)] * 4 and 0.0 < evaluated[4] == pytest.approx(evaluated[8])
    assert evaluated[9] > evaluated[8] and not (run / ".evaluating").exists()

    summary = json.loads((run / "summary.json").read_text())
    assert summary["param_count"] == 71_657 and summary["steps"] == 10
    assert summary["leader_counts"] == [5, 5]
    assert summary["total_bytes"] == sum(r["bytes"] for r in records)
    assert summary["final_accuracy"] == records[-1]["accuracy"]
    histograms = json.loads((run / "data.json").read_text())["label_histograms"]
    assert len(histograms) == 2 and sum(map(sum, histograms)) == 512

    elsewhere = tmp_path / "report"
    report.main([str(run), "--out", str(elsewhere)])
    for name in ("accuracy.png", "step_time.png", "gain.png", "leaders.png", "summary.md"):
        assert (elsewhere / name).stat().st_size > 0
    table = (elsewhere / "summary.md").read_text()
    assert "| run | alexnet x0.05 | artopk-star |" in table


def test_the_report_plots_measured_quality_where_a_run_records_it_without_a_gain(tmp_path: Path) -> None:
    records = [{"step": i, "gain": None, "quality": 0.8} for i in range(4)]
    quality_only = report.Run(tmp_path, "lowrank", records, {}, None, True)
    no_statistic = report.Run(tmp_path, "dense", [{"step": 0, "gain": None, "quality": None}], {}, None, True)
    assert report.plot_gain([quality_only], tmp_path / "gain.png") == tmp_path / "gain.png"
    assert (tmp_path / "gain.png").stat().st_size > 0
    assert report.plot_gain([no_statistic], tmp_path / "none.png") is None


def test_rank_failure_is_reported(tmp_path: Path) -> None:
    """Both ranks fail to find their data (the CLI's checks are bypassed on purpose)."""
    cfg = TrainConfig(dataset="npz", data_dir=str(tmp_path / "missing"), net="none", steps=3, timeout=30)
    cfg.save(tmp_path)
    with pytest.raises(RankFailed, match=r"rank [01] failed: FileNotFoundError: --dataset npz needs train.npz"):
        run_job(cfg, tmp_path)


def report_error(tmp_path: Path, rank: int, error: str) -> str:
    """Python code that reports ``error`` as rank ``rank`` does (see rank_files.write_error), then exits 1."""
    info = f"{{'time': time.time(), 'error': {error!r}}}"
    path = str(error_file(tmp_path, rank))
    return f"import json, sys, time; open({path!r}, 'w').write(json.dumps({info})); sys.exit(1)"


def test_supervisor_stops_the_others(tmp_path: Path) -> None:
    failing = report_error(tmp_path, 1, "ValueError: boom")
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    crasher = subprocess.Popen([sys.executable, "-c", failing])
    started = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1 failed: ValueError: boom"):
        supervise([RankProcess(0, sleeper), RankProcess(1, crasher)], explain=explain_failure(tmp_path, 2))
    assert sleeper.poll() is not None and time.monotonic() - started < 30


def test_silent_death_is_blamed_first(tmp_path: Path) -> None:
    """A rank killed without a word is the cause; its peer's error is only the consequence."""
    peer = subprocess.Popen([sys.executable, "-c", report_error(tmp_path, 0, "peer lost")])
    killed = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    peer.wait()
    killed.wait()
    with pytest.raises(RankFailed, match="rank 1 was killed by signal 9 without reporting an error"):
        supervise([RankProcess(0, peer), RankProcess(1, killed)], explain=explain_failure(tmp_path, 2))
