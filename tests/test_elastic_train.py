"""flexcomm-train --resume on another --nproc: 2 ranks, then 1 (fewer), then 3 (more), one run directory.

Each resume continues from the newest checkpoint: the records hold every step once (no
second step 0) with epochs counting up, the checkpoint sets record who wrote them, and
each resized rank says what became of its error-feedback residuals.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexcomm.train import checkpoint, cli
from flexcomm.train.records import RECORDS_FILE

RUN = [
    "--dataset", "synthetic", "--train-subset", "384", "--test-subset", "64", "--model", "mlp", "--width", "0.1",
    "--eval-every", "4", "--net", "none", "--threads", "1", "--checkpoint-every", "4", "--no-report",
    "--compressor", "flex", "--density", "auto",
]


def test_resume_on_fewer_then_more_ranks_continues_the_run(tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    out = ["--out", str(tmp_path)]
    cli.main(RUN + out + ["--nproc", "2", "--steps", "8"])
    cli.main(RUN + out + ["--nproc", "1", "--steps", "12", "--resume"])
    fewer = capfd.readouterr()
    cli.main(RUN + out + ["--nproc", "3", "--steps", "16", "--resume"])
    more = capfd.readouterr()
    assert "resuming" in fewer.out and "at step 8" in fewer.out and "at step 12" in more.out
    assert "saved by 2 ranks resumes on 1 rank at step 8: rank 0 keeps its own error-feedback residuals plus " \
           "those of departed ranks [1]" in fewer.err
    assert "rank 2 is new: its error-feedback residuals start at zero" in more.err
    records = [json.loads(line) for line in (tmp_path / RECORDS_FILE).read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(16))
    epochs = [r["epoch"] for r in records]
    assert epochs == sorted(epochs) and epochs[8] > epochs[7] and epochs[12] > epochs[11]  # a fresh epoch per resize
    latest = checkpoint.read_latest(tmp_path)
    assert (latest["steps"], latest["nproc"]) == ([16, 12], [3, 1])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["world_size"] == 3 and summary["steps"] == 16
