"""PyTorch's PowerSGD baseline in the training app: it runs on gloo with a model DDP would split into buckets."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from flexcomm.train import baselines, cli
from flexcomm.train.models import build_model

WIDTH = 0.25  # AlexNet-style, 1.8M parameters: DDP's default buckets (1 MiB first, then 25 MiB) give several
STEPS = 8


def test_powersgd_gets_one_bucket_on_gloo_only() -> None:
    model = build_model("alexnet", 10, 1, 28, WIDTH)
    grad_mib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20
    assert grad_mib > 1  # more than DDP's default first bucket
    assert baselines.bucket_cap_mb("powersgd", "gloo", model) == math.ceil(grad_mib)
    assert baselines.bucket_cap_mb("powersgd", "nccl", model) is None
    assert baselines.bucket_cap_mb("fp16", "gloo", model) is None
    # A requested cap holds for everything but PowerSGD on gloo, which keeps its one bucket.
    assert baselines.bucket_cap_mb("powersgd", "gloo", model, 0.5) == math.ceil(grad_mib)
    assert baselines.bucket_cap_mb("powersgd", "nccl", model, 0.5) == 0.5
    assert baselines.bucket_cap_mb("agtopk", "gloo", model, 64.0) == 64.0
    assert baselines.bucket_cap_mb("agtopk", "nccl", model, "one") == math.ceil(grad_mib)
    with pytest.raises(ValueError, match="bucket_cap_mb must be a number of MiB or 'one', got 'two'"):
        baselines.bucket_cap_mb("agtopk", "gloo", model, "two")


def _train(run: Path, *options: str) -> dict:
    cli.main([
        "--dataset", "synthetic", "--train-subset", "512", "--test-subset", "128", "--model", "alexnet",
        "--width", str(WIDTH), "--steps", str(STEPS), "--eval-every", str(STEPS), "--net", "none", "--threads", "1",
        "--no-report", "--timeout", "60", "--out", str(run), *options,
    ])
    return json.loads((run / "summary.json").read_text())


def test_powersgd_trains_on_gloo(tmp_path: Path) -> None:
    """PyTorch's hook issues allreduces from Future callbacks; with several gloo buckets this crashed."""
    run = tmp_path / "run"
    summary = _train(run, "--compressor", "powersgd", "--bucket-cap-mb", "0.5")
    assert summary["buckets"] == 1  # the requested cap would have split the model: PowerSGD keeps one bucket
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    start = baselines.POWERSGD_MIN_START
    assert all(r["exchanges"] == ["allreduce"] for r in records[:start])
    assert all(r["exchanges"] == ["powersgd"] and r["density"] < 0.1 for r in records[start:])
    assert all(math.isfinite(r["loss"]) for r in records)


def test_bucket_cap_sets_ddps_buckets(tmp_path: Path) -> None:
    """--bucket-cap-mb reaches DDP: DDP's default splits this model, 'one' does not."""
    default = _train(tmp_path / "default", "--compressor", "agtopk")
    capped = _train(tmp_path / "capped", "--compressor", "agtopk", "--bucket-cap-mb", "one")
    assert default["buckets"] > 1
    assert capped["buckets"] == 1 and capped["config"]["bucket_cap_mb"] == "one"
