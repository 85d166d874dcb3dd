"""PyTorch's PowerSGD baseline in the training app: it runs on gloo with a model DDP would split into buckets."""

from __future__ import annotations

import json
import math
from pathlib import Path

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


def test_powersgd_trains_on_gloo(tmp_path: Path) -> None:
    """PyTorch's hook issues allreduces from Future callbacks; with several gloo buckets this crashed."""
    run = tmp_path / "run"
    cli.main([
        "--dataset", "synthetic", "--train-subset", "512", "--test-subset", "128", "--model", "alexnet",
        "--width", str(WIDTH), "--steps", str(STEPS), "--eval-every", str(STEPS), "--net", "none", "--threads", "1",
        "--compressor", "powersgd", "--no-report", "--timeout", "60", "--out", str(run),
    ])
    records = [json.loads(line) for line in (run / "records.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(STEPS))
    start = baselines.POWERSGD_MIN_START
    assert all(r["exchanges"] == ["allreduce"] for r in records[:start])
    assert all(r["exchanges"] == ["powersgd"] and r["density"] < 0.1 for r in records[start:])
    assert all(math.isfinite(r["loss"]) for r in records)
