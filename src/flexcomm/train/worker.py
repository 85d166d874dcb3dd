"""One rank of a ``flexcomm-train`` run: ``python -m flexcomm.train.worker RUN_DIR/config.json``.

The rank learns who it is from the environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), as under ``torchrun``, and joins the
job with :func:`flexcomm.init_process_group` (``env://``, safe across torchrun's
restarts): gloo on CPU, NCCL on a GPU of its own (see :mod:`flexcomm.train.devices`,
``--device``).  Nothing assumes the ranks share a
machine except the run directory, which every rank reads its config from and writes its
checkpoint to.  ``kill -USR1`` prints a rank's Python stacks to its stderr.

Rank 0 writes the logs (see :mod:`flexcomm.train.records`), ``data.json`` (partition
sizes and per-rank label histograms) and ``summary.json``, and shows the progress bar.
A rank that fails writes ``error-rank<r>.json`` so the launcher can say why.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import logging
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from time import perf_counter
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel
from tqdm import tqdm

from flexcomm.rendezvous import init_process_group
from flexcomm.train import checkpoint, resume
from flexcomm.train.baselines import bucket_cap_mb
from flexcomm.train.config import TrainConfig
from flexcomm.train.devices import choose_device
from flexcomm.train.timed_hook import StepComm, TimedHook
from flexcomm.train.rank_data import (
    Arrays,
    DataClock,
    batch_indices,
    label_histograms,
    load_arrays,
    partitions,
    rank_tensors,
    steps_per_epoch,
)
from flexcomm.train.models import build_model, count_parameters
from flexcomm.train.rank_files import EVALUATING_MARKER, STARTED_MARKER, error_file, write_error
from flexcomm.train.records import RecordWriter, read_records, summarize, write_summary

DATA_FILE = "data.json"
EVAL_BATCH = 500

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Identity:
    """Who this process is in the job, where it computes, and its group's backend."""

    rank: int
    world_size: int
    device: torch.device
    backend: str

    @classmethod
    def from_env(cls, requested_device: str = "auto") -> Identity:
        try:
            rank, world = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE"))
        except KeyError as exc:
            raise SystemExit(f"flexcomm.train.worker needs {exc.args[0]} in its environment; use flexcomm-train")
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device, backend = choose_device(requested_device, os.environ, gpus)
        return cls(rank, world, device, backend)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m flexcomm.train.worker", description="One rank of flexcomm-train.")
    parser.add_argument("config", type=Path, help="the run's config.json, written by flexcomm-train")
    config_path = parser.parse_args(argv).config
    # `kill -USR1 <pid>` prints every thread's Python stack to stderr and carries on: where
    # a stuck rank waits, without a debugger (the chaos benchmark records fault points so).
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    cfg = TrainConfig.load(config_path)
    me = Identity.from_env(cfg.device)
    try:
        run_rank(cfg, config_path.parent, me)
    except Exception as exc:
        if not error_file(config_path.parent, me.rank).exists():
            write_error(config_path.parent, me.rank, exc)
        raise


def run_rank(cfg: TrainConfig, run_dir: Path, me: Identity) -> None:
    """Join the process group, train, leave."""
    torch.set_num_threads(cfg.threads)
    if me.device.type == "cuda":
        # Before the group exists: NCCL and every later allocation then use this rank's GPU.
        torch.cuda.set_device(me.device)
    device_id = {"device_id": me.device} if me.backend == "nccl" else {}
    init_process_group(me.backend, timeout=timedelta(seconds=cfg.timeout), **device_id)
    try:
        Trainer(cfg, run_dir, me).run()
    except Exception as exc:
        # Written before the group is torn down: peers fail only once it is, so the
        # launcher sees the original error first (by its time stamp).
        write_error(run_dir, me.rank, exc)
        raise
    finally:
        dist.destroy_process_group()


def _should_resume(cfg: TrainConfig, run_dir: Path) -> bool:
    """``--resume``, or a run under a restarting launcher (torchrun, flexcomm-train) that has a checkpoint.

    Such launchers restart every worker of the group after a failure and set
    ``TORCHELASTIC_RESTART_COUNT``; the restarted workers continue from the last
    checkpoint.  The count itself is not compared with 0: torchrun agents on different
    nodes count differently (one restarted by another node's failure does not count it),
    while the checkpoint every rank reads is the same.
    """
    restartable = "TORCHELASTIC_RESTART_COUNT" in os.environ
    return cfg.resume or (restartable and (checkpoint.checkpoint_dir(run_dir) / checkpoint.LATEST_FILE).exists())


def _rank_seed(seed: int, rank: int) -> int:
    """A per-rank seed for dropout etc.: ranks must not draw identical masks."""
    return int(np.random.SeedSequence([seed, rank]).generate_state(1)[0])


class Trainer:
    """Model, data, exchange and optimizer of one rank, and the loop over steps."""

    def __init__(self, cfg: TrainConfig, run_dir: Path, me: Identity) -> None:
        if cfg.steps is None:
            raise ValueError("config.json has no resolved step count; start runs with flexcomm-train")
        # torchrun --nnodes MIN:MAX may start another rank count than config.json's: partition for this one.
        cfg = replace(cfg, nproc=me.world_size)
        self.cfg, self.run_dir, self.me = cfg, run_dir, me
        self.arrays: Arrays = load_arrays(cfg)
        self.parts = partitions(self.arrays.train_y, cfg)
        self.per_epoch = steps_per_epoch(self.parts, cfg.batch_size)
        self.clock = DataClock(self.per_epoch)
        self.data = rank_tensors(self.arrays, self.parts[me.rank], me.rank, me.world_size, me.device)
        torch.manual_seed(cfg.seed)  # the same initial model on every rank
        arrays = self.arrays
        model = build_model(cfg.model, arrays.num_classes, arrays.in_channels, arrays.image_size, cfg.width)
        self.param_count = count_parameters(model)
        device_ids = [me.device.index] if me.device.type == "cuda" else None
        # PowerSGD on gloo needs one bucket (see flexcomm.train.baselines); everything else as asked.
        buckets = bucket_cap_mb(cfg.compressor, me.backend, model, cfg.bucket_cap_mb)
        self.ddp = DistributedDataParallel(model.to(me.device), device_ids=device_ids, bucket_cap_mb=buckets)
        self.hook = TimedHook(cfg)
        self.hook.register(self.ddp)
        self.hook.prime(self.ddp, self.data.train_x[: cfg.batch_size], self.data.train_y[: cfg.batch_size])
        self.optimizer = torch.optim.SGD(self.ddp.parameters(), lr=cfg.lr, momentum=cfg.momentum)
        torch.manual_seed(_rank_seed(cfg.seed, me.rank))
        #: Seconds spent evaluating (in ``wall``, not in ``train_wall`` nor on the link's schedule).
        self.evaluated = 0.0
        self.start_step, self.elapsed_before = self._restore() if _should_resume(cfg, run_dir) else (0, 0.0)

    # -- checkpoints ---------------------------------------------------------------
    def _restore(self) -> tuple[int, float]:
        """Load this rank's newest checkpoint (saved on any rank count); return (step to continue from, wall time so far)."""
        me = self.me
        saved = resume.load_newest_usable(self.run_dir, me.rank, me.world_size, me.device)
        checkpoint.check_compatible(saved.own["meta"]["config"], self.cfg, checkpoint.checkpoint_dir(self.run_dir))
        resume.check_data_order(saved, self.arrays.train_y, self.cfg, self.per_epoch)
        self.ddp.module.load_state_dict(saved.own["model"])
        self.optimizer.load_state_dict(saved.own["optimizer"])
        resume.load_comm(self.hook, saved, me.rank, me.world_size)
        self.clock = resume.data_clock(saved, self.per_epoch, me.world_size)
        if saved.is_own(me.rank):  # a new rank keeps the seed it started with: its draws are its own
            torch.set_rng_state(saved.own["rng"]["torch"].cpu())
            if saved.own["rng"]["cuda"] is not None:
                torch.cuda.set_rng_state(saved.own["rng"]["cuda"].cpu(), me.device)
        self.evaluated = float(saved.own.get("evaluated", 0.0))  # absent from checkpoints written before it
        return saved.step, float(saved.own["elapsed"])

    def _save(self, steps_done: int, elapsed: float) -> None:
        """Every rank saves its file; rank 0 publishes the set once all exist; then old files go."""
        cuda = self.me.device.type == "cuda"
        epoch, batch = self.clock.position(steps_done)
        state = {
            "model": self.ddp.module.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "comm": self.hook.state_dict(),
            "rng": {"torch": torch.get_rng_state(), "cuda": torch.cuda.get_rng_state(self.me.device) if cuda else None},
            # The order itself is a function of (seed, epoch, rank); the position follows from the step.
            "data_order": {"steps_per_epoch": self.per_epoch, "epoch": epoch, "batch": batch,
                           "origin": [self.clock.origin_step, self.clock.origin_epoch]},
            "elapsed": elapsed,
            "evaluated": self.evaluated,
        }
        checkpoint.save_rank(self.run_dir, self.cfg, self.me.rank, steps_done, state)
        self._barrier()
        if self.me.rank == 0:
            checkpoint.publish(self.run_dir, self.cfg, steps_done)
        self._barrier()
        checkpoint.prune(self.run_dir, self.me.rank, self.me.world_size)

    # -- the loop ------------------------------------------------------------------
    def run(self) -> None:
        cfg, lead = self.cfg, self.me.rank == 0
        writer = RecordWriter(self.run_dir, self.start_step) if lead else None
        if lead:
            self._announce()
        self._barrier()
        if lead:
            (self.run_dir / STARTED_MARKER).touch()
        # A live bar on a terminal; elsewhere (a log file, a pipe) one line per evaluation, see _show.
        live = lead and sys.stderr.isatty()
        bar = tqdm(total=cfg.steps, initial=self.start_step, disable=not live, unit="step", dynamic_ncols=True)
        t0 = perf_counter() - self.elapsed_before
        accuracy: float | None = None
        try:
            for step in range(self.start_step, cfg.steps):
                record = self._train_step(step)
                done = step + 1 == cfg.steps
                if (step + 1) % cfg.eval_every == 0 or done:
                    with self._evaluating():
                        accuracy, record["test_loss"] = self.evaluate()
                    record["accuracy"] = accuracy
                    done = done or (cfg.target_acc is not None and accuracy >= cfg.target_acc)
                record["wall"] = perf_counter() - t0
                record["train_wall"] = record["wall"] - self.evaluated
                if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0 or done):
                    self._save(step + 1, perf_counter() - t0)
                if writer is not None:
                    writer.write(record)
                    _show(bar, record, accuracy)
                if done:
                    break
        finally:
            bar.close()
            if writer is not None:
                writer.close()
        if lead:
            self._write_summary()

    def _train_step(self, step: int) -> dict[str, Any]:
        started = perf_counter()
        cfg = self.cfg
        epoch, batch = self.clock.position(step)
        positions = batch_indices(len(self.data.train_y), epoch, batch, cfg.batch_size, cfg.seed, self.me.rank)
        index = torch.from_numpy(positions).to(self.me.device)
        x, y = self.data.train_x[index], self.data.train_y[index]
        self.hook.begin_step()
        computing = perf_counter()
        loss = F.cross_entropy(self.ddp(x), y)
        loss.backward()
        backward_end = self._now()
        comm = self.hook.end_step(backward_end)
        if comm.finite:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        finished = self._now()
        return {
            "step": step,
            "epoch": epoch,
            "loss": loss.item(),
            "t_step": finished - started,
            "t_compute": backward_end - computing,
            "t_optim": finished - backward_end,
            **_comm_fields(comm),
        }

    @contextmanager
    def _evaluating(self) -> Iterator[None]:
        """Time an evaluation; rank 0 holds the evaluating marker meanwhile (the link's schedule stands still)."""
        marker = self.run_dir / EVALUATING_MARKER
        if self.me.rank == 0:
            marker.touch()
        began = perf_counter()
        try:
            yield
        finally:
            self.evaluated += perf_counter() - began
            if self.me.rank == 0:
                marker.unlink(missing_ok=True)

    def evaluate(self) -> tuple[float, float]:
        """Accuracy and mean loss of rank 0's model on the (sharded) test set.

        Rank 0's buffers (BatchNorm statistics) are broadcast first, as DDP does before
        every forward, so every shard is scored by the same model.
        """
        module = self.ddp.module
        for buffer in module.buffers():
            dist.broadcast(buffer, 0)
        module.eval()
        correct, loss_sum = 0, 0.0
        x, y = self.data.test_x, self.data.test_y
        with torch.no_grad():
            for i in range(0, len(y), EVAL_BATCH):
                logits = module(x[i : i + EVAL_BATCH])
                loss_sum += float(F.cross_entropy(logits, y[i : i + EVAL_BATCH], reduction="sum"))
                correct += int((logits.argmax(1) == y[i : i + EVAL_BATCH]).sum())
        module.train()
        totals = torch.tensor([correct, loss_sum, len(y)], dtype=torch.float64, device=self.me.device)
        dist.all_reduce(totals)
        correct_all, loss_all, n = totals.tolist()
        return correct_all / n, loss_all / n

    # -- rank 0's reporting --------------------------------------------------------
    def _announce(self) -> None:
        cfg, arrays = self.cfg, self.arrays
        histograms = label_histograms(arrays.train_y, self.parts, arrays.num_classes)
        info = {
            "num_classes": arrays.num_classes,
            "in_channels": arrays.in_channels,
            "image_size": arrays.image_size,
            "train_samples": len(arrays.train_y),
            "test_samples": len(arrays.test_y),
            "steps_per_epoch": self.per_epoch,
            "partition": cfg.partition,
            "partition_sizes": [len(p) for p in self.parts],
            "label_histograms": histograms,
        }
        (self.run_dir / DATA_FILE).write_text(json.dumps(info, indent=2) + "\n")
        resumed = f", resuming at step {self.start_step}" if self.start_step else ""
        exchange = (f"{cfg.compressor} at rank {cfg.powersgd_rank}" if cfg.powersgd_rank
                    else cfg.compressor if cfg.density is None else f"{cfg.compressor} at density {cfg.density}")
        tqdm.write(
            f"flexcomm-train: {cfg.model} x{cfg.width:g} with {self.param_count:,} parameters on {self.me.world_size} "
            f"rank(s) ({self.me.backend}, {self.me.device}); {exchange}; "
            f"{len(arrays.train_y):,} training samples, {self.per_epoch} steps per epoch; {cfg.steps} steps{resumed}"
        )

    def _write_summary(self) -> None:
        summary = {
            "config": self.cfg.to_dict(),
            "param_count": self.param_count,
            "world_size": self.me.world_size,
            "backend": self.me.backend,
            "device": str(self.me.device),
            "torch_version": torch.__version__,
            "buckets": self.hook.buckets,
            "leader_counts": self.hook.leader_counts,
            "density_decisions": self.hook.density_decisions,
            **summarize(read_records(self.run_dir), self.cfg.target_acc),
        }
        write_summary(self.run_dir, summary)

    # -- helpers -------------------------------------------------------------------
    def _now(self) -> float:
        """``perf_counter`` after the device finished its queued work (CUDA is asynchronous)."""
        if self.me.device.type == "cuda":
            torch.cuda.synchronize(self.me.device)
        return perf_counter()

    def _barrier(self) -> None:
        if self.me.device.type == "cuda":
            dist.barrier(device_ids=[self.me.device.index])
        else:
            dist.barrier()


def _comm_fields(comm: StepComm) -> dict[str, Any]:
    fields = asdict(comm)
    fields["bytes"] = fields.pop("bytes_sent")
    return fields


def _show(bar: tqdm, record: dict[str, Any], accuracy: float | None) -> None:
    bar.set_postfix(
        loss=f"{record['loss']:.3f}",
        acc="-" if accuracy is None else f"{accuracy:.3f}",
        density=f"{record['density']:.3g}",
        exch="+".join(record["exchanges"]) or "-",
        step_ms=f"{record['t_step'] * 1e3:.0f}",
        refresh=False,
    )
    bar.update(1)
    if bar.disable and record.get("accuracy") is not None:
        print(
            f"step {record['step'] + 1}/{bar.total}  loss {record['loss']:.3f}  acc {record['accuracy']:.3f}  "
            f"density {record['density']:.3g}  {record['wall']:.1f} s",
            flush=True,
        )


if __name__ == "__main__":
    main()
    # The run is complete and its files are closed: exit without interpreter finalization,
    # where a rank now and then aborted ("terminate called without an active exception",
    # cause not found) and turned a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
