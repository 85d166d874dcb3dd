"""FlexCommStrategy in real 2-rank Lightning trainers on CPU/gloo: the hook runs, checkpoints keep every rank's state."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

pl = pytest.importorskip("lightning.pytorch", reason="needs the lightning extra: pip install flexcomm[lightning]")

import flexcomm  # noqa: E402
from flexcomm.lightning import FlexCommStrategy  # noqa: E402
from flexcomm.rank_states import CHECKPOINT_KEY  # noqa: E402
from multiproc import run_world  # noqa: E402
from same_state import assert_same_state as _assert_same  # noqa: E402

STEPS_PER_EPOCH = 4  # 128 samples, 2 ranks, batches of 16


class Net(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same initial model in every run
        self.layers = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return nn.functional.cross_entropy(self.layers(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

    def train_dataloader(self) -> DataLoader:
        generator = torch.Generator().manual_seed(1)
        x = torch.randn(128, 20, generator=generator)
        y = torch.randint(0, 4, (128,), generator=generator)
        return DataLoader(TensorDataset(x, y), batch_size=16)


class StateAtTrainStart(pl.Callback):
    """This rank's hook state when training starts, i.e. after a checkpoint was restored."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.state = trainer.strategy.state.state_dict()


def _trainer(rank: int, strategy: Any, root: str, epochs: int, **kwargs: Any) -> pl.Trainer:
    # Ranks are started outside Lightning (as by torchrun): LOCAL_RANK tells it so.
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0")
    return pl.Trainer(
        accelerator="cpu", devices=2, strategy=strategy, max_epochs=epochs, default_root_dir=root,
        logger=False, enable_progress_bar=False, enable_model_summary=False, **kwargs,
    )


def _parameters(module: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in module.parameters()]


def _train_plain_and_flexcomm(rank: int, world_size: int, root: str) -> dict[str, Any]:
    plain = Net()
    _trainer(rank, pl.strategies.DDPStrategy(), root, 1, enable_checkpointing=False).fit(plain)
    strategy = FlexCommStrategy(compressor="agtopk", density=0.05)
    flex = Net()
    _trainer(rank, strategy, root, 1, enable_checkpointing=False).fit(flex)
    return {
        "plain": _parameters(plain),
        "flex": _parameters(flex),
        "state_type": type(strategy.state),
        "records": strategy.state.drain_records(),
    }


def test_strategy_runs_flexcomm_on_cpu(tmp_path: Path) -> None:
    """Lightning's own comm-hook route trains plain DDP on CPU; the strategy's updates are flexcomm's."""
    results = run_world(_train_plain_and_flexcomm, 2, str(tmp_path))
    for result in results:
        assert result["state_type"] is flexcomm.FlexState
        steps = {record.step for record in result["records"]}
        assert steps == set(range(STEPS_PER_EPOCH))
        assert all(record.k < record.numel for record in result["records"])  # sparse: density 0.05
    for name in ("plain", "flex"):  # DDP keeps the ranks' models equal, both ways
        assert all(torch.equal(a, b) for a, b in zip(results[0][name], results[1][name]))
    assert not all(torch.equal(a, b) for a, b in zip(results[0]["plain"], results[0]["flex"]))


def _save_then_resume(rank: int, world_size: int, root: str) -> dict[str, Any]:
    checkpoints = pl.callbacks.ModelCheckpoint(dirpath=root, save_last=True)
    first = FlexCommStrategy(compressor="artopk-star", density=0.05)
    _trainer(rank, first, root, 1, callbacks=[checkpoints]).fit(Net())
    saved = first.state.state_dict()

    restored = StateAtTrainStart()
    second = FlexCommStrategy(compressor="artopk-star", density=0.05)
    _trainer(rank, second, root, 2, callbacks=[restored], enable_checkpointing=False).fit(
        Net(), ckpt_path=str(Path(root) / "last.ckpt")
    )
    return {"saved": saved, "restored": restored.state, "after": second.state.state_dict()}


def test_checkpoint_gives_every_rank_its_own_state(tmp_path: Path) -> None:
    results = run_world(_save_then_resume, 2, str(tmp_path))
    in_file = torch.load(tmp_path / "last.ckpt", weights_only=False)[CHECKPOINT_KEY]
    assert len(in_file) == 2
    for rank, result in enumerate(results):
        _assert_same(in_file[rank], result["saved"])
        _assert_same(result["restored"], result["saved"])  # its own, bit for bit
        assert result["after"]["step"] == 2 * STEPS_PER_EPOCH  # and training went on from there
    with pytest.raises(AssertionError):  # the ranks' residuals differ: a mix-up would be seen
        _assert_same(results[0]["saved"]["memory"], results[1]["saved"]["memory"])


def test_strategy_refuses_a_second_hook() -> None:
    with pytest.raises(TypeError, match="registers flexcomm's hook itself; remove ddp_comm_hook"):
        FlexCommStrategy(ddp_comm_hook=flexcomm.hook)
    with pytest.raises(ValueError, match="unknown compressor 'topk'"):
        FlexCommStrategy(compressor="topk")
