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
        assert_same_training_state(runs["interrupted"], runs["straight"], rank, 8)


def assert_same_training_state(resumed_run: Path, straight_run: Path, rank: int, step: int) -> None:
    """Model, momentum, the hook's residuals and counters, RNG: everything but the clock."""
    resumed = checkpoint.load_rank(resumed_run, rank, step)
    straight = checkpoint.load_rank(straight_run, rank, step)
    for part in ("model", "optimizer", "comm", "rng"):
        assert_identical(resumed[part], straight[part], f"rank {rank} {part}")


def test_resumed_log_is_whole(runs: dict[str, Path]) -> None:
    def losses(run: Path) -> list[tuple[int, float]]:
        return [(r["step"], r["loss"]) for r in map(json.loads, (run / "records.jsonl").read_text().splitlines())]

    assert losses(runs["interrupted"]) == losses(runs["straight"])
    summary = json.loads((runs["interrupted"] / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["config"]["resume"] is True


def test_the_two_newest_complete_sets_are_kept(tmp_path: Path) -> None:
    cfg = TrainConfig()
    for step in (3, 6, 9):
        for rank in (0, 1):
            checkpoint.save_rank(tmp_path, cfg, rank, step, {"x": torch.arange(step)})
        checkpoint.publish(tmp_path, cfg, step)
        for rank in (0, 1):
            checkpoint.prune(tmp_path, rank, 2)
    assert checkpoint.read_latest(tmp_path)["steps"] == [9, 6]
    files = sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir())
    assert files == ["latest.json", *(checkpoint.rank_file(tmp_path, r, s).name for s in (6, 9) for r in (0, 1))]


def test_a_run_resumed_on_fewer_ranks_prunes_the_departed_ranks_files(tmp_path: Path) -> None:
    for step, nproc in ((3, 2), (6, 2), (9, 1), (12, 1)):
        cfg = TrainConfig(nproc=nproc)
        for rank in range(nproc):
            checkpoint.save_rank(tmp_path, cfg, rank, step, {})
        checkpoint.publish(tmp_path, cfg, step)
        for rank in range(nproc):
            checkpoint.prune(tmp_path, rank, nproc)
        if step == 9:  # step 6's set, written by 2 ranks, is still the fallback
            assert checkpoint.read_latest(tmp_path)["nproc"] == [1, 2]
            assert checkpoint.rank_file(tmp_path, 1, 6).exists()
    files = sorted(p.name for p in checkpoint.checkpoint_dir(tmp_path).iterdir())
    assert files == ["latest.json", checkpoint.rank_file(tmp_path, 0, 9).name, checkpoint.rank_file(tmp_path, 0, 12).name]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (["--compressor", "agtopk"], "--compressor 'artopk-star' (this run: 'agtopk')"),
        (["--batch-size", "16"], "--batch-size 32 (this run: 16)"),
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


def test_truncated_only_checkpoint_is_refused(
    runs: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(runs["at4"], broken)
    victim = checkpoint.rank_file(broken, 1, 4)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(SystemExit):
        cli.main(RUN + ["--steps", "8", "--out", str(broken), "--resume"])
    err = capsys.readouterr().err
    assert "no complete, undamaged checkpoint" in err and f"checkpoint file {victim} is truncated or corrupt" in err
    # What the rank itself calls on resume, in case the file broke after the launcher's check.
    with pytest.raises(checkpoint.CheckpointError, match="is truncated or corrupt"):
        checkpoint.load_rank(broken, 1, 4)


def test_flipped_byte_is_detected(runs: dict[str, Path], tmp_path: Path) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(runs["at4"], broken)
    victim = checkpoint.rank_file(broken, 0, 4)
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    with pytest.raises(checkpoint.CheckpointError, match="SHA-256 does not match"):
        checkpoint.load_rank(broken, 0, 4)


def test_launcher_check_falls_back_past_a_damaged_newest_set(
    runs: dict[str, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = tmp_path / "broken"
    shutil.copytree(runs["straight"], broken)
    victim = checkpoint.rank_file(broken, 0, 8)
    victim.write_bytes(victim.read_bytes()[:100])
    cfg, _ = cli.parse_config(RUN + ["--steps", "12", "--out", str(broken), "--resume"])
    assert checkpoint.validate_resume(broken, cfg) == 4
    assert f"checkpoint file {victim} is truncated or corrupt" in caplog.text


def test_ranks_agree_to_fall_back_when_one_rank_has_a_damaged_newest_file(
    runs: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    """Rank 1's step-8 file is truncated, rank 0's is fine: both resume from step 4, and the
    result equals the uninterrupted run's bit for bit (the ranks, not the launcher, decide here,
    as under torchrun)."""
    broken = tmp_path / "broken"
    shutil.copytree(runs["straight"], broken)
    victim = checkpoint.rank_file(broken, 1, 8)
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size - 10])
    monkeypatch.setattr(checkpoint, "validate_resume", lambda run_dir, cfg: 8)  # skip the launcher's own check
    cli.main(RUN + ["--steps", "8", "--out", str(broken), "--resume"])
    out, err = capfd.readouterr()
    assert "resuming at step 4" in out
    assert f"rank 1: cannot resume: checkpoint file {victim} is truncated or corrupt" in err
    assert "rank 0: the checkpoint at step 8 is damaged on a rank; trying the previous one" in err
    for rank in (0, 1):
        assert_same_training_state(broken, runs["straight"], rank, 8)


def test_atomic_write_leaves_nothing_behind(tmp_path: Path) -> None:
    cfg = TrainConfig()
    path = checkpoint.save_rank(tmp_path, cfg, 0, 3, {"x": torch.arange(3)})
    with pytest.raises((AttributeError, pickle.PicklingError)):
        checkpoint.save_rank(tmp_path, cfg, 0, 3, {"x": lambda: None})  # not picklable: fails mid-write
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert torch.equal(checkpoint.load_rank(tmp_path, 0, 3)["x"], torch.arange(3))
