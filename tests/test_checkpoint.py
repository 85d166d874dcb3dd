"""Checkpoints: atomic files, exact resume, and refusal of checkpoints that do not fit.

The resume test trains 4 steps with checkpoints, resumes to 8, and compares with an
uninterrupted 8-step run: parameters, momentum and error-feedback residuals must be
bitwise equal.  That holds on CPU because the data order is a function of the step,
RNG states are restored, gloo's 2-rank sums are order-independent, and DDP's buckets
are primed to the same layout (AlexNet x0.1 has two buckets after DDP regroups them,
so a resume without priming would drop the residuals and diverge).
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from flexcomm.train import checkpoint, cli
from flexcomm.train.config import TrainConfig

RUN = [
    "--dataset", "synthetic", "--train-subset", "512", "--test-subset", "64", "--model", "alexnet",
    "--width", "0.1", "--eval-every", "4", "--net", "none", "--threads", "1", "--checkpoint-every", "4",
    "--no-report",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``interrupted``: 4 steps then resumed to 8; ``at4``: a copy of it at step 4; ``straight``: 8 steps."""
    root = tmp_path_factory.mktemp("ckpt")
    interrupted, at4, straight = root / "interrupted", root / "at4", root / "straight"
    cli.main(RUN + ["--steps", "4", "--out", str(interrupted)])
    shutil.copytree(interrupted, at4)
    cli.main(RUN + ["--steps", "8", "--out", str(interrupted), "--resume"])
    cli.main(RUN + ["--steps", "8", "--out", str(straight)])
    return {"interrupted": interrupted, "at4": at4, "straight": straight}


def assert_identical(resumed: object, straight: object, where: str = "") -> None:
    """Nested dicts/lists of tensors and plain values, compared exactly (tensors bitwise)."""
    if isinstance(straight, torch.Tensor):
        assert isinstance(resumed, torch.Tensor) and torch.equal(resumed, straight), where
    elif isinstance(straight, dict):
        assert isinstance(resumed, dict) and resumed.keys() == straight.keys(), where
        for key in straight:
            assert_identical(resumed[key], straight[key], f"{where}/{key}")
    elif isinstance(straight, (list, tuple)):
        assert isinstance(resumed, (list, tuple)) and len(resumed) == len(straight), where
        for i, (r, s) in enumerate(zip(resumed, straight)):
            assert_identical(r, s, f"{where}/{i}")
    else:
        assert resumed == straight, where


def test_resume_matches_an_uninterrupted_run(runs: dict[str, Path]) -> None:
    for rank in (0, 1):
        resumed = torch.load(checkpoint.rank_file(runs["interrupted"], rank, 8), weights_only=True)
        straight = torch.load(checkpoint.rank_file(runs["straight"], rank, 8), weights_only=True)
        # Model, momentum, the hook's residuals and counters, RNG: everything but the clock.
        for part in ("model", "optimizer", "comm", "rng"):
            assert_identical(resumed[part], straight[part], f"rank {rank} {part}")


def test_resumed_log_is_whole(runs: dict[str, Path]) -> None:
    def losses(run: Path) -> list[tuple[int, float]]:
        return [(r["step"], r["loss"]) for r in map(json.loads, (run / "records.jsonl").read_text().splitlines())]

    assert losses(runs["interrupted"]) == losses(runs["straight"])
    summary = json.loads((runs["interrupted"] / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["config"]["resume"] is True


def test_only_the_newest_checkpoint_is_kept(runs: dict[str, Path]) -> None:
    files = sorted(p.name for p in checkpoint.checkpoint_dir(runs["straight"]).iterdir())
    assert files == ["latest.json", "step00000008-rank0.pt", "step00000008-rank1.pt"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--compressor", "agtopk"], "--compressor 'artopk-star' (this run: 'agtopk')"),
        (["--nproc", "1"], "--nproc 2 (this run: 1)"),
        (["--model", "resnet18"], "--model 'alexnet' (this run: 'resnet18')"),
    ],
)
def test_mismatched_checkpoint_is_refused(
    runs: dict[str, Path], change: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(RUN + ["--steps", "8", "--out", str(runs["at4"]), "--resume", *change])
    assert exc.value.code == 2
    assert "cannot resume from" in (err := capsys.readouterr().err) and message in err


def test_finished_checkpoint_needs_more_steps(runs: dict[str, Path], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli.main(RUN + ["--steps", "4", "--out", str(runs["at4"]), "--resume"])
    assert "the checkpoint is at step 4, and this run stops at step 4" in capsys.readouterr().err


def test_truncated_checkpoint_is_refused(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(runs["at4"], broken)
    victim = checkpoint.rank_file(broken, 1, 4)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(SystemExit):
        cli.main(RUN + ["--steps", "8", "--out", str(broken), "--resume"])
    assert f"checkpoint file {victim} is truncated or corrupt" in capsys.readouterr().err
    # What the rank itself calls on resume, in case the file broke after the launcher's check.
    with pytest.raises(checkpoint.CheckpointError, match="is truncated or corrupt"):
        checkpoint.load_rank(broken, 1, 4)


def test_atomic_write_leaves_nothing_behind(tmp_path: Path) -> None:
    cfg = TrainConfig()
    path = checkpoint.save_rank(tmp_path, cfg, 0, 3, {"x": torch.arange(3)})
    with pytest.raises((AttributeError, pickle.PicklingError)):
        checkpoint.save_rank(tmp_path, cfg, 0, 3, {"x": lambda: None})  # not picklable: fails mid-write
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert torch.equal(checkpoint.load_rank(tmp_path, 0, 3)["x"], torch.arange(3))
