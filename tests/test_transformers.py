"""flexcomm.transformers.register in real 2-rank Transformers Trainers on CPU/gloo: the hook runs,
checkpoints keep every rank's state, and a resumed run ends bitwise where an uninterrupted one does."""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

transformers = pytest.importorskip("transformers", reason="needs the transformers extra: pip install flexcomm[transformers]")

import flexcomm.transformers  # noqa: E402
from multiproc import raised, run_world  # noqa: E402
from same_state import assert_same_state  # noqa: E402

STEPS = 30
SAVE_AT = 20
LOG_EVERY = 10
VOCAB = 64


def _tiny_bert() -> Any:
    torch.manual_seed(0)  # the same initial model in every run
    config = transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        max_position_embeddings=16,
    )
    return transformers.BertForMaskedLM(config)


def _tokens() -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (64, 12), generator=generator)
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(rank: int, world_size: int, output_dir: str, **args: Any) -> Any:
    # Started as torchrun would; the process group already exists, so Trainer joins it.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    options = {
        "max_steps": STEPS, "per_device_train_batch_size": 4, "learning_rate": 1e-3, "use_cpu": True, "seed": 0,
        "save_strategy": "steps", "save_steps": SAVE_AT, "logging_steps": LOG_EVERY, "report_to": "none",
        "disable_tqdm": True, **args,
    }
    arguments = transformers.TrainingArguments(output_dir=output_dir, **options)
    return transformers.Trainer(model=_tiny_bert(), args=arguments, train_dataset=_tokens())


def _parameters(trainer: Any) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def _train(rank: int, world_size: int, output_dir: str, resume: str | bool | None, **state_args: Any) -> dict[str, Any]:
    """One Trainer run (flexcomm if ``state_args``, else plain DDP): final parameters, flexcomm's warnings, and
    the hook's decisions ``(step, bucket, exchange, density)``."""
    trainer = _trainer(rank, world_size, output_dir)
    callback = flexcomm.transformers.register(trainer, **state_args) if state_args else None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=resume)
    records = callback.state.drain_records() if callback else []
    return {
        "parameters": _parameters(trainer),
        "warnings": [str(w.message) for w in caught if str(w.message).startswith("flexcomm")],
        "decisions": [(r.step, r.bucket, r.exchange, r.density) for r in records],
        "log_rows": [row for row in trainer.state.log_history if "loss" in row],
    }


def _uninterrupted_and_resumed(rank: int, world_size: int, root: str, resume_by_path: bool,
                               state_args: dict[str, Any]) -> dict[str, Any]:
    """An uninterrupted flexcomm run saving at SAVE_AT, and a fresh job resuming from that checkpoint."""
    full = _train(rank, world_size, f"{root}/full", None, **state_args)
    dist.barrier()  # every rank's checkpoint files are written
    if rank == 0:
        if resume_by_path:  # a copy elsewhere, resumed into a new output_dir: only the path can find it
            shutil.copytree(f"{root}/full/checkpoint-{SAVE_AT}", f"{root}/moved")
        else:  # as if the job had died after step SAVE_AT: its newest checkpoint is SAVE_AT's
            shutil.rmtree(f"{root}/full/checkpoint-{STEPS}")
    dist.barrier()
    if resume_by_path:
        resumed = _train(rank, world_size, f"{root}/resumed", f"{root}/moved", **state_args)
    else:
        resumed = _train(rank, world_size, f"{root}/full", True, **state_args)
    return {"full": full, "resumed": resumed}


def _resumed_by_path_and_plain(rank: int, world_size: int, root: str, state_args: dict[str, Any]) -> dict[str, Any]:
    """:func:`_uninterrupted_and_resumed` resuming from an explicit path, and plain DDP's run."""
    runs = _uninterrupted_and_resumed(rank, world_size, root, True, state_args)
    return {**runs, "plain": _train(rank, world_size, f"{root}/plain", None)}


def _assert_resumes_bitwise(results: list[dict[str, Any]]) -> None:
    for result in results:
        full, resumed = result["full"], result["resumed"]
        assert full["warnings"] == [] and resumed["warnings"] == []
        assert_same_state(resumed["parameters"], full["parameters"])
        # The resumed hook carries on from step SAVE_AT, deciding as the uninterrupted one did.
        assert resumed["decisions"] and resumed["decisions"] == [d for d in full["decisions"] if d[0] >= SAVE_AT]
    assert_same_state(results[0]["full"]["parameters"], results[1]["full"]["parameters"])


def _assert_own_files(checkpoint: Path, compressor: str) -> list[dict[str, Any]]:
    """Each rank's file holds that rank's state at SAVE_AT; returns them."""
    saved = [torch.load(checkpoint / flexcomm.transformers.state_file(r), weights_only=True) for r in range(2)]
    for rank, state in enumerate(saved):
        assert (state["rank"], state["step"], state["compressor"]) == (rank, SAVE_AT, compressor)
    return saved


def test_resume_from_explicit_path_is_bitwise(tmp_path: Path) -> None:
    results = run_world(_resumed_by_path_and_plain, 2, str(tmp_path), {"compressor": "artopk-star", "density": 0.05})
    _assert_resumes_bitwise(results)
    for result in results:
        with pytest.raises(AssertionError):  # the hook ran: not plain DDP's parameters
            assert_same_state(result["full"]["parameters"], result["plain"]["parameters"])
    for run in ("full", "resumed"):  # Trainer's training log rows carry the hook's metrics of that step
        rows = results[0][run]["log_rows"]  # the resumed run's: SAVE_AT's and before from the checkpoint
        assert [row["step"] for row in rows] == list(range(LOG_EVERY, STEPS + 1, LOG_EVERY))
        assert all(row["flexcomm/step"] == row["step"] - 1 and row["flexcomm/density"] == 0.05 for row in rows)
    saved = _assert_own_files(tmp_path / "full" / f"checkpoint-{SAVE_AT}", "artopk-star")
    with pytest.raises(AssertionError):  # the ranks' residuals differ: a mix-up would be seen
        assert_same_state(saved[0]["memory"], saved[1]["memory"])


def test_flex_auto_density_resumes_latest_checkpoint_bitwise(tmp_path: Path) -> None:
    # flex re-decides from measured times every flex_interval (10) steps: the resumed steps 20-29 follow the
    # decision made at step 20 from the restored state, so timing noise cannot make the two runs differ.
    results = run_world(_uninterrupted_and_resumed, 2, str(tmp_path), False, {"compressor": "flex", "density": "auto"})
    _assert_resumes_bitwise(results)
    _assert_own_files(tmp_path / "full" / f"checkpoint-{SAVE_AT}", "flex")


def _resume_plain_checkpoint(rank: int, world_size: int, root: str) -> dict[str, Any]:
    _train(rank, world_size, root, None)  # plain DDP: its checkpoint has no flexcomm files
    dist.barrier()
    return _train(rank, world_size, root, f"{root}/checkpoint-{SAVE_AT}", compressor="agtopk", density=0.05)


def test_resume_without_flexcomm_state_warns_once(tmp_path: Path) -> None:
    rank0, rank1 = run_world(_resume_plain_checkpoint, 2, str(tmp_path))
    (message,) = rank0["warnings"]
    assert "holds no flexcomm hook state" in message and "zero residuals" in message
    assert rank1["warnings"] == []
    assert rank0["decisions"][0][0] == 0  # the hook ran, from step 0


def _register_on_one_process(rank: int, world_size: int, root: str) -> str:
    trainer = _trainer(rank, world_size, root)
    try:
        flexcomm.transformers.register(trainer, compressor="agtopk")
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_one_process_says_launch_more(tmp_path: Path) -> None:
    (message,) = run_world(_register_on_one_process, 1, str(tmp_path))
    assert "single-process run" in message and "torchrun --nproc-per-node 2" in message


def _train_twice(rank: int, world_size: int, root: str) -> tuple[bool, int]:
    trainer = _trainer(rank, world_size, root, max_steps=5, save_strategy="no")
    callback = flexcomm.transformers.register(trainer, compressor="agtopk", density=0.05)
    trainer.train()
    first = callback.state
    trainer.train()  # DDP takes one hook per model: the second train() must not register again
    return callback.state is first, first.step


def test_second_train_keeps_the_hook_and_its_state(tmp_path: Path) -> None:
    for same_state, steps in run_world(_train_twice, 2, str(tmp_path)):
        assert same_state and steps == 10


def _begin_unwrapped(rank: int, world_size: int, root: str) -> str:
    trainer = _trainer(rank, world_size, root)
    callback = flexcomm.transformers.register(trainer, compressor="agtopk")
    # As if Trainer had not wrapped the model in DDP (FSDP, DeepSpeed): the model it trains is the bare one.
    return raised(lambda: callback.on_train_begin(trainer.args, trainer.state, trainer.control))


def test_model_not_wrapped_in_ddp_says_so(tmp_path: Path) -> None:
    for message in run_world(_begin_unwrapped, 2, str(tmp_path)):
        assert "needs Trainer to wrap the model in DistributedDataParallel, got BertForMaskedLM" in message
