"""flexcomm's metrics reach the user's loggers: a real Lightning Trainer with CSVLogger and a real Accelerator
with a tracker, each on 2 CPU/gloo ranks, with no logging code of the user's."""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import flexcomm
from multiproc import run_world

EPOCHS = 2
LOG_EVERY = 2


def _step_bytes(records: list[flexcomm.BucketRecord]) -> dict[int, int]:
    """Bytes sent per hook step, from one rank's records."""
    sent: dict[int, int] = {}
    for record in records:
        sent[record.step] = sent.get(record.step, 0) + record.bytes_sent
    return sent


def _fit_with_csv_logger(rank: int, world_size: int, root: str) -> list[flexcomm.BucketRecord]:
    from lightning.pytorch import Trainer
    from lightning.pytorch.loggers import CSVLogger
    from test_lightning import Net

    from flexcomm.lightning import FlexCommStrategy

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")  # ranks started outside Lightning, as by torchrun
    strategy = FlexCommStrategy(compressor="flex", density=0.05)
    trainer = Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=EPOCHS, default_root_dir=root,
        logger=CSVLogger(root, name="run", version=0), log_every_n_steps=LOG_EVERY,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False,
    )
    trainer.fit(Net())
    return strategy.state.drain_records()


def test_lightning_csv_logger_gets_flexcomm_metrics(tmp_path: Path) -> None:
    pytest.importorskip("lightning.pytorch", reason="needs the lightning extra: pip install flexcomm[lightning]")
    from test_lightning import STEPS_PER_EPOCH

    records = run_world(_fit_with_csv_logger, 2, str(tmp_path))[0]
    with open(tmp_path / "run" / "version_0" / "metrics.csv") as file:
        rows = [row for row in csv.DictReader(file) if row.get("flexcomm/density")]
    due = [s for s in range(EPOCHS * STEPS_PER_EPOCH) if (s + 1) % LOG_EVERY == 0]
    assert [int(row["step"]) for row in rows] == due
    assert [int(float(row["flexcomm/step"])) for row in rows] == due  # Lightning's step is the hook's step
    sent = _step_bytes(records)
    for row in rows:
        step = int(row["step"])
        assert float(row["flexcomm/bytes_sent"]) == sent[step] > 0  # rank 0's own bytes of that step
        compressed = float(row["flexcomm/share_dense"]) + float(row["flexcomm/share_dense16"]) < 1.0
        assert float(row["flexcomm/density"]) == pytest.approx(0.05 if compressed else 1.0)
        assert float(row["flexcomm/predicted_exchange_time_s"]) > 0.0  # flex predicts its exchanges


def _recording_tracker() -> Any:
    """An Accelerate tracker that keeps what it receives (defined here: accelerate is an optional extra)."""
    from accelerate.tracking import GeneralTracker

    class Recording(GeneralTracker):
        name = "recording"
        requires_logging_directory = False

        def __init__(self) -> None:
            super().__init__()
            self.logged: list[tuple[int | None, dict[str, Any]]] = []

        @property
        def tracker(self) -> list[tuple[int | None, dict[str, Any]]]:
            return self.logged

        def store_init_configuration(self, values: dict[str, Any]) -> None:
            pass

        def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
            self.logged.append((step, dict(values)))

    return Recording()


def _train_with_tracker(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    import accelerate

    import flexcomm.accelerate

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    tracker = _recording_tracker()
    accelerator = accelerate.Accelerator(cpu=True, log_with=[tracker])
    accelerator.init_trackers("telemetry")
    torch.manual_seed(0)
    model = accelerator.prepare(nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 4)))
    state = flexcomm.accelerate.register(accelerator, model, log_every=LOG_EVERY, compressor="agtopk", density=0.05)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(steps):
        x, y = torch.randn(16, 20, generator=generator), torch.randint(0, 4, (16,), generator=generator)
        accelerator.backward(nn.functional.cross_entropy(model(x), y))
    with torch.no_grad():
        model(torch.randn(4, 20))  # an evaluation: the last step is known finished now
    return {"logged": tracker.logged, "records": state.drain_records()}


def test_accelerate_tracker_gets_flexcomm_metrics() -> None:
    pytest.importorskip("accelerate", reason="needs the accelerate extra: pip install flexcomm[accelerate]")
    steps = 4
    main, other = run_world(_train_with_tracker, 2, steps)
    assert other["logged"] == []  # only the main process logs
    due = [s for s in range(steps) if (s + 1) % LOG_EVERY == 0]
    assert [step for step, _ in main["logged"]] == due
    sent = _step_bytes(main["records"])
    for step, values in main["logged"]:
        assert values["flexcomm/step"] == step
        assert values["flexcomm/density"] == 0.05
        assert values["flexcomm/share_agtopk"] == 1.0
        assert values["flexcomm/bytes_sent"] == sent[step] > 0
        assert "flexcomm/predicted_exchange_time_s" not in values  # a fixed compressor has no cost model
