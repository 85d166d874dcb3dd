"""flexcomm-train's command line: every bad input is refused, clearly, before any rank starts.

All in-process and cheap: ``run_job`` is replaced by a function that fails the test, so
reaching it means a rank would have been started.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

import flexcomm
from flexcomm.train import cli
from flexcomm.train.config import TrainConfig

SMALL = ["--dataset", "synthetic", "--train-subset", "256", "--test-subset", "64", "--net", "none"]


@pytest.fixture(autouse=True)
def no_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(cfg: TrainConfig, run_dir: Path, max_restarts: int = 0) -> None:
        raise AssertionError("a rank was started")

    monkeypatch.setattr(cli, "run_job", refuse)


def refused(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run the CLI, expect a usage error, return its message."""
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def out(tmp_path: Path) -> list[str]:
    return ["--out", str(tmp_path / "run")]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "lenet"], "argument --model: invalid choice: 'lenet'"),
        (["--compressor", "topk"], "argument --compressor: invalid choice: 'topk'"),
        (["--density", "0"], "argument --density: must be in (0, 1], got 0"),
        (["--density", "1.5"], "argument --density: must be in (0, 1], got 1.5"),
        (["--density", "lots"], "argument --density: expected a number, got 'lots'"),
        (["--nproc", "0"], "argument --nproc: must be >= 1, got 0"),
        (["--batch-size", "-3"], "argument --batch-size: must be >= 1, got -3"),
        (["--lr", "nan"], "argument --lr: must be in (0, inf), got nan"),
        (["--momentum", "1.2"], "argument --momentum: must be in [0, 1], got 1.2"),
        (["--target-acc", "2"], "argument --target-acc: must be in (0, 1], got 2"),
        (["--width", "0"], "argument --width: must be in (0, inf), got 0"),
        (["--auto-min-gain", "1.5"], "argument --auto-min-gain: must be in [0, 1], got 1.5"),
        (["--net", "1gbit,100mbit"], "argument --net: phase '1gbit' has no duration but is not the last phase"),
        (["--net", "fast:10s"], "argument --net: bad rate 'fast'"),
        (["--steps", "5", "--epochs", "1"], "argument --epochs: not allowed with argument --steps"),
        (["--dirichlet-alpha", "0.3"], "--dirichlet-alpha only applies to --partition dirichlet"),
        (["--powersgd-rank", "2"], "--powersgd-rank only applies to --compressor powersgd or lowrank"),
        (["--compressor", "lowrank", "--density", "0.1"], "--density does not apply to --compressor lowrank"),
        (["--compressor", "fp16", "--density", "0.1"], "--density does not apply to --compressor fp16"),
        (["--compressor", "fp16", "--warmup-steps", "5"], "--warmup-steps does not apply to --compressor fp16"),
        (["--dataset", "npz"], "--dataset npz needs --data-dir"),
        (["--resume"], "--resume needs --out DIR"),
        (["--max-restarts", "-1"], "argument --max-restarts: must be >= 0, got -1"),
        (["--bucket-cap-mb", "0"], "argument --bucket-cap-mb: must be in (0, inf), got 0"),
        (["--bucket-cap-mb", "all"], "argument --bucket-cap-mb: expected a number of MiB or 'one', got 'all'"),
        pytest.param(["--device", "cuda"], "--device cuda, but torch sees no CUDA device",
                     marks=pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")),
    ],
)
def test_bad_option_is_refused(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert message in refused(argv + ["--net", "none"] if "--net" not in argv else argv, capsys)


def test_compressors_come_from_the_package() -> None:
    choices = cli.build_parser()._option_string_actions["--compressor"].choices
    assert set(flexcomm.COMPRESSORS) <= set(choices)
    assert {"powersgd", "fp16"} <= set(choices)


@pytest.mark.parametrize(("compressor", "rank"), [("lowrank", []), ("lowrank", ["--powersgd-rank", "2"]), ("powersgd", [])])
def test_factor_rank_defaults_per_compressor(compressor: str, rank: list[str], tmp_path: Path) -> None:
    cfg, _ = cli.parse_config(SMALL + ["--compressor", compressor, *rank] + out(tmp_path))
    assert cfg.powersgd_rank == (int(rank[1]) if rank else {"lowrank": 4, "powersgd": 1}[compressor])


def test_emulation_requested_but_unavailable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "netem_available", lambda: (False, "no CAP_NET_ADMIN here"))
    err = refused(SMALL[:-2] + ["--net", "1gbit:5s,100mbit"], capsys)
    assert "--net 1gbit:5s,100mbit: network emulation is unavailable here: no CAP_NET_ADMIN here" in err


def test_auto_network_falls_back_to_loopback(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "netem_available", lambda: (False, "not root"))
    cfg, notes = cli.parse_config(SMALL[:-2] + ["--net", "auto"] + out(tmp_path))
    assert cfg.net == "none"
    assert any("network emulation unavailable (not root); using plain loopback" in n for n in notes)


def test_auto_network_emulates_when_it_can(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "netem_available", lambda: (True, "ok"))
    cfg, _ = cli.parse_config(SMALL[:-2] + out(tmp_path))
    assert cfg.net == cli.AUTO_SCHEDULE


def test_good_options_resolve(tmp_path: Path) -> None:
    argv = SMALL + ["--epochs", "2", "--partition", "dirichlet", "--batch-size", "16"]
    cfg, _ = cli.parse_config(argv + out(tmp_path))
    assert cfg.dirichlet_alpha == 0.5 and cfg.density == cli.DEFAULT_DENSITY
    assert cfg.steps is not None and cfg.steps >= 2
    assert (tmp_path / "run").is_dir()
    auto_cfg, _ = cli.parse_config(SMALL + ["--density", "auto", "--out", str(tmp_path / "a")])
    assert auto_cfg.density == "auto"
    torch_cfg, _ = cli.parse_config(SMALL + ["--compressor", "powersgd"] + ["--out", str(tmp_path / "p")])
    assert torch_cfg.density is None and torch_cfg.powersgd_rank == 1


def test_unwritable_out(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    err = refused(SMALL + ["--out", str(blocker / "run")], capsys)
    assert f"--out {blocker / 'run'}: cannot write there" in err


def test_out_holding_a_run_is_not_overwritten(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "records.jsonl").write_text("")
    assert "already holds a run; pass --resume" in refused(SMALL + out(tmp_path), capsys)


def test_resume_without_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "run").mkdir()
    assert "has no checkpoint" in refused(SMALL + out(tmp_path) + ["--resume"], capsys)


def test_missing_data_dir(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["--dataset", "fashion-mnist", "--data-dir", str(tmp_path / "nothing"), "--net", "none"], capsys)
    assert "--dataset fashion-mnist: dataset directory" in err and "does not exist" in err


def test_subsets_are_caps(tmp_path: Path) -> None:
    np.savez(tmp_path / "train.npz", x=np.zeros((50, 16, 16), np.uint8), y=np.arange(50) % 3)
    np.savez(tmp_path / "test.npz", x=np.zeros((10, 16, 16), np.uint8), y=np.arange(10) % 3)
    argv = ["--dataset", "npz", "--data-dir", str(tmp_path), "--net", "none", "--batch-size", "5", "--epochs", "1"]
    cfg, _ = cli.parse_config(argv + out(tmp_path))
    assert cfg.steps == 5  # 25 samples per rank, the default --train-subset 10000 capped at 50


def test_too_little_data_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    err = refused(["--dataset", "synthetic", "--train-subset", "40", "--net", "none"], capsys)
    assert "rank 0 gets only 20 training samples, fewer than --batch-size 32" in err


def test_model_that_does_not_fit_the_images(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    np.savez(tmp_path / "train.npz", x=np.zeros((64, 30, 30), np.uint8), y=np.arange(64) % 2)
    np.savez(tmp_path / "test.npz", x=np.zeros((8, 30, 30), np.uint8), y=np.arange(8) % 2)
    argv = ["--dataset", "npz", "--data-dir", str(tmp_path), "--net", "none", "--train-subset", "0", "--model", "vit"]
    err = refused(argv, capsys)
    assert "--model vit --width 0.125 does not fit the data (1x30x30 images)" in err
    assert "divisible by patch_size" in err


def test_prepare_only_writes_the_config_and_starts_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cli.main(SMALL + ["--steps", "3", "--prepare-only"] + out(tmp_path))
    printed = capsys.readouterr().out
    assert "torchrun --nnodes NODES" in printed and "-m flexcomm.train.worker" in printed
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["config.json"]
