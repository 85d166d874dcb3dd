"""``flexcomm-train``: data-parallel training with a flexcomm (or PyTorch) DDP comm hook.

With no arguments, 2 ranks train a narrow ResNet-18 for two
epochs on a Fashion-MNIST subset with AR-Topk (STAR) at density 0.01, over an emulated network
whose bandwidth drops from 1 Gbit/s to 100 Mbit/s after 20 s (plain loopback where
emulation is unavailable), then writes the report.

Every option is checked before any rank starts, because a mistake found by N ranks
half-way through start-up is reported N times, late, and mixed with their output:
names, ranges, option combinations, the bandwidth schedule (with netem's own parser),
whether emulation works here, the data set (loaded once), whether the model fits the
data (a forward pass on the meta device, which costs no memory), the output directory
and, with ``--resume``, every rank's checkpoint.  The ranks are then started by
:mod:`flexcomm.train.job` (with the one launcher, :mod:`flexcomm.launch`).
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time
from pathlib import Path

import torch

from flexcomm.compress.lowrank import DEFAULT_RANK
from flexcomm.control import RULES
from flexcomm.netem import MAX_HOSTS, netem_available
from flexcomm.train import checkpoint
from flexcomm.train.arg_types import bucket_cap, density_or_auto, float_in, int_at_least, net_schedule
from flexcomm.train.config import TORCH_COMPRESSORS, TrainConfig, available_compressors
from flexcomm.train.rank_data import (
    DATASETS,
    DEFAULT_DIRICHLET_ALPHA,
    PARTITIONS,
    Arrays,
    load_arrays,
    partitions,
    steps_per_epoch,
)
from flexcomm.launch import RankFailed
from flexcomm.train.job import run_job
from flexcomm.train.models import MODEL_NAMES, build_model
from flexcomm.train.records import RECORDS_FILE

#: What ``--net auto`` emulates: a fast link that turns slow mid-run.
AUTO_SCHEDULE = "1gbit:20s,100mbit"
DEFAULT_DENSITY = 0.01
DEFAULT_EPOCHS = 2.0

_DEFAULTS = TrainConfig()


# -- the parser --------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexcomm-train",
        description=__doc__.split("\n\n")[1] if __doc__ else None,
        epilog=(
            "Ranks are subprocesses running `python -m flexcomm.train.worker RUN_DIR/config.json` with torchrun's "
            "environment variables; with an emulated network, one per emulated host. If a rank fails, the others "
            "are stopped and flexcomm-train exits non-zero with that rank's error."
        ),
    )
    model = parser.add_argument_group("model and data")
    model.add_argument("--model", choices=MODEL_NAMES, default=_DEFAULTS.model, help="(default: %(default)s)")
    model.add_argument("--width", type=float_in(0.0, math.inf), default=_DEFAULTS.width, metavar="W",
                       help="multiplier of every layer width, for CPU-sized models (default: %(default)s)")
    model.add_argument("--dataset", choices=DATASETS, default=_DEFAULTS.dataset,
                       help="npz: --data-dir holds train.npz and test.npz with arrays x and y (default: %(default)s)")
    model.add_argument("--data-dir", metavar="DIR",
                       help="where the data set is (fashion-mnist: /usr/share/datasets/fashion-mnist)")
    model.add_argument("--train-subset", type=int_at_least(0), default=_DEFAULTS.train_subset, metavar="N",
                       help="use the first N training samples (all if fewer); 0 = all (default: %(default)s)")
    model.add_argument("--test-subset", type=int_at_least(0), default=_DEFAULTS.test_subset, metavar="N",
                       help="evaluate on the first N test samples (all if fewer); 0 = all (default: %(default)s)")
    model.add_argument("--partition", choices=PARTITIONS, default=_DEFAULTS.partition,
                       help="how training samples are split over ranks (default: %(default)s)")
    model.add_argument("--dirichlet-alpha", type=float_in(0.0, math.inf), metavar="ALPHA",
                       help="label skew of --partition dirichlet; smaller = more skewed "
                            f"(default: {DEFAULT_DIRICHLET_ALPHA})")

    comm = parser.add_argument_group("gradient exchange")
    comm.add_argument("--compressor", choices=available_compressors(), default=_DEFAULTS.compressor, metavar="NAME",
                      help="one of {%(choices)s}: flexcomm's compressors, or PyTorch's PowerSGD and fp16 hooks "
                           "as baselines (default: %(default)s)")
    comm.add_argument("--density", type=density_or_auto, metavar="C",
                      help=f"fraction of each bucket's elements sent, in (0, 1], or 'auto' for the dynamic "
                           f"compression-ratio controller; flexcomm compressors only (default: {DEFAULT_DENSITY})")
    comm.add_argument("--warmup-steps", type=int_at_least(0), default=_DEFAULTS.warmup_steps, metavar="N",
                      help="exchange dense for the first N steps; PowerSGD: at least 2 (default: %(default)s)")
    comm.add_argument("--powersgd-rank", type=int_at_least(1), metavar="R",
                      help="the factors' rank of PowerSGD (default: 1) and of --compressor lowrank (default: 4)")
    comm.add_argument("--bucket-cap-mb", type=bucket_cap, metavar="MB",
                      help="DDP's bucket_cap_mb: gradients are exchanged in buckets of about this many MiB, or "
                           "'one' for one bucket holding every gradient (default: DDP's own, 25 with a 1 MiB first "
                           "bucket); PyTorch's PowerSGD on gloo always gets one bucket (its collectives pair up only then)")
    comm.add_argument("--auto-warmup", type=int_at_least(0), default=_DEFAULTS.auto_warmup, metavar="N",
                      help="--density auto: dense steps before the controller's first decision; 0: it "
                           "decides at step 1, so a slow link runs sparse from step 1 or 2 (default: %(default)s)")
    comm.add_argument("--auto-every", type=int_at_least(1), default=_DEFAULTS.auto_every, metavar="N",
                      help="--density auto: least steps between gain measurements (default: %(default)s)")
    comm.add_argument("--auto-rule", choices=RULES, default=_DEFAULTS.auto_rule,
                      help="--density auto: how a point of the Pareto front is picked (default: %(default)s)")
    comm.add_argument("--auto-min-gain", type=float_in(0.0, 1.0, low_open=False), default=_DEFAULTS.auto_min_gain, metavar="G",
                      help="--density auto: the accuracy floor, no density whose measured gain (the share of "
                           "the error-corrected gradient's norm it sends) is below G; 0: off (default: %(default)s)")

    run = parser.add_argument_group("cluster")
    run.add_argument("--nproc", type=int_at_least(1), default=_DEFAULTS.nproc, metavar="N",
                     help="number of ranks (default: %(default)s)")
    run.add_argument("--net", type=net_schedule, default=_DEFAULTS.net, metavar="SCHEDULE",
                     help=f"bandwidth schedule of an emulated network, e.g. 1gbit:30s,50mbit:30s,300mbit; "
                          f"'none' = plain loopback; 'auto' = {AUTO_SCHEDULE} where emulation works, else loopback "
                          "(default: %(default)s)")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default=_DEFAULTS.device,
                     help="where ranks compute: 'cuda' puts each rank on its own GPU of its machine (NCCL; gloo "
                          "with CUDA tensors when ranks outnumber GPUs); 'auto' = cuda where available "
                          "(default: %(default)s)")
    run.add_argument("--threads", type=int_at_least(1), metavar="N",
                     help="torch threads per rank (default: CPU cores / --nproc, at least 1)")
    run.add_argument("--timeout", type=float_in(0.0, math.inf), default=_DEFAULTS.timeout, metavar="SECONDS",
                     help="process-group timeout: a rank stuck this long in a collective fails the job "
                          "(default: %(default)s)")
    run.add_argument("--max-restarts", type=int_at_least(0), default=0, metavar="N",
                     help="when a rank fails, stop every rank and start the group again, up to N times; the ranks "
                          "resume from the last checkpoint (see --checkpoint-every) (default: %(default)s)")

    train = parser.add_argument_group("training")
    length = train.add_mutually_exclusive_group()
    length.add_argument("--steps", type=int_at_least(1), metavar="N", help="number of steps")
    length.add_argument("--epochs", type=float_in(0.0, math.inf), metavar="E",
                        help=f"number of epochs (default: {DEFAULT_EPOCHS:g}, unless --steps is given)")
    train.add_argument("--batch-size", type=int_at_least(1), default=_DEFAULTS.batch_size, metavar="N",
                       help="per rank (default: %(default)s)")
    train.add_argument("--lr", type=float_in(0.0, math.inf), default=_DEFAULTS.lr,
                       help="SGD learning rate (default: %(default)s)")
    train.add_argument("--momentum", type=float_in(0.0, 1.0, low_open=False), default=_DEFAULTS.momentum,
                       help="SGD momentum (default: %(default)s)")
    train.add_argument("--eval-every", type=int_at_least(1), default=_DEFAULTS.eval_every, metavar="N",
                       help="evaluate every N steps and at the end (default: %(default)s)")
    train.add_argument("--target-acc", type=float_in(0.0, 1.0), metavar="ACC",
                       help="stop at the first evaluation with at least this test accuracy; the time to it is recorded")
    train.add_argument("--seed", type=int_at_least(0), default=_DEFAULTS.seed,
                       help="seeds the model, the partition, the data order and dropout (default: %(default)s)")

    output = parser.add_argument_group("output")
    output.add_argument("--out", metavar="DIR", help="run directory (default: runs/<timestamp>-<model>-<compressor>)")
    output.add_argument("--checkpoint-every", type=int_at_least(0), default=_DEFAULTS.checkpoint_every, metavar="N",
                        help="checkpoint every N steps and at the end; 0 = never (default: %(default)s)")
    output.add_argument("--resume", action="store_true", help="continue the run in --out from its newest checkpoint")
    output.add_argument("--no-report", action="store_true",
                        help="skip the report at the end (in sweeps: run flexcomm-report over all runs afterwards)")
    output.add_argument("--prepare-only", action="store_true",
                        help="validate, write --out/config.json and print the torchrun command that runs it "
                             "(for multi-node jobs), without starting any rank")
    return parser


# -- validation ---------------------------------------------------------------------------
def parse_config(argv: list[str] | None = None) -> tuple[TrainConfig, list[str]]:
    """Parse and fully validate a command line; return the resolved config and notes to print.

    Errors exit through ``parser.error`` (status 2) with a message naming the option.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    notes: list[str] = []
    try:
        _check_combinations(args)
        net = _resolve_net(args.net, args.nproc, notes)
        cfg = _config_from(args, net)
        arrays, per_epoch = _check_data(cfg)
        cfg.steps = args.steps or max(1, math.ceil((args.epochs or DEFAULT_EPOCHS) * per_epoch))
        _check_model_fits(cfg, arrays)
        cfg.out = str(_prepare_out(args.out, cfg))
        if cfg.resume:
            step = checkpoint.validate_resume(Path(cfg.out), cfg)
            notes.append(f"flexcomm-train: resuming {cfg.out} at step {step}")
    except _OptionError as exc:
        parser.error(str(exc))
    except checkpoint.CheckpointError as exc:
        parser.error(f"--resume: {exc}")
    return cfg, notes


class _OptionError(ValueError):
    """A bad option value or combination; the message names the option."""


def _check_combinations(args: argparse.Namespace) -> None:
    flexcomm_compressor = args.compressor not in TORCH_COMPRESSORS
    if args.dirichlet_alpha is not None and args.partition != "dirichlet":
        raise _OptionError("--dirichlet-alpha only applies to --partition dirichlet")
    if args.powersgd_rank is not None and args.compressor not in ("powersgd", "lowrank"):
        raise _OptionError("--powersgd-rank only applies to --compressor powersgd or lowrank")
    if args.density is not None and args.compressor == "lowrank":
        raise _OptionError("--density does not apply to --compressor lowrank (it sends rank-r factors: --powersgd-rank)")
    if args.density is not None and not flexcomm_compressor:
        raise _OptionError(f"--density does not apply to --compressor {args.compressor}")
    if args.warmup_steps and args.compressor == "fp16":
        raise _OptionError("--warmup-steps does not apply to --compressor fp16")
    if args.data_dir is not None and args.dataset == "synthetic":
        raise _OptionError("--data-dir does not apply to --dataset synthetic")
    if args.dataset == "npz" and args.data_dir is None:
        raise _OptionError("--dataset npz needs --data-dir (a directory with train.npz and test.npz)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise _OptionError("--device cuda, but torch sees no CUDA device on this machine (use --device cpu)")
    if args.resume and args.out is None:
        raise _OptionError("--resume needs --out DIR, the run directory to continue")


def _resolve_net(net: str, nproc: int, notes: list[str]) -> str:
    """The schedule to emulate, or ``"none"``; ``auto`` falls back to loopback with a note."""
    if net == "none":
        return "none"
    available, reason = netem_available()
    if net == "auto":
        if available:
            return AUTO_SCHEDULE
        notes.append(f"flexcomm-train: network emulation unavailable ({reason}); using plain loopback")
        return "none"
    if not available:
        raise _OptionError(
            f"--net {net}: network emulation is unavailable here: {reason}; use --net none for plain loopback"
        )
    if nproc > MAX_HOSTS:
        raise _OptionError(f"--nproc {nproc}: an emulated network has at most {MAX_HOSTS} hosts")
    return net


def _config_from(args: argparse.Namespace, net: str) -> TrainConfig:
    flexcomm_compressor = args.compressor not in TORCH_COMPRESSORS
    alpha = args.dirichlet_alpha
    if args.partition == "dirichlet" and alpha is None:
        alpha = DEFAULT_DIRICHLET_ALPHA
    return TrainConfig(
        model=args.model,
        width=args.width,
        dataset=args.dataset,
        data_dir=args.data_dir,
        train_subset=args.train_subset,
        test_subset=args.test_subset,
        partition=args.partition,
        dirichlet_alpha=alpha,
        compressor=args.compressor,
        # dense sends every element whatever --density says: record what it does.
        density=(1.0 if args.compressor == "dense" else args.density or DEFAULT_DENSITY) if flexcomm_compressor else None,
        warmup_steps=args.warmup_steps,
        auto_warmup=args.auto_warmup,
        auto_every=args.auto_every,
        auto_rule=args.auto_rule,
        auto_min_gain=args.auto_min_gain,
        powersgd_rank=_factor_rank(args),
        bucket_cap_mb=args.bucket_cap_mb,
        nproc=args.nproc,
        net=net,
        epochs=args.epochs,
        batch_size=args.batch_size,
        lr=args.lr,
        momentum=args.momentum,
        eval_every=args.eval_every,
        target_acc=args.target_acc,
        seed=args.seed,
        checkpoint_every=args.checkpoint_every,
        resume=args.resume,
        timeout=args.timeout,
        threads=args.threads or max(1, (os.cpu_count() or 1) // args.nproc),
        device=args.device,
        report=not args.no_report,
    )


def _check_data(cfg: TrainConfig) -> tuple[Arrays, int]:
    """Load the data once, as the ranks will, and split it; return it and the steps per epoch."""
    try:
        arrays = load_arrays(cfg)
    except (OSError, ValueError) as exc:
        raise _OptionError(f"--dataset {cfg.dataset}: {exc}") from None
    try:
        parts = partitions(arrays.train_y, cfg)
        per_epoch = steps_per_epoch(parts, cfg.batch_size)
    except ValueError as exc:
        raise _OptionError(f"--partition {cfg.partition} over --nproc {cfg.nproc}: {exc}") from None
    return arrays, per_epoch


def _check_model_fits(cfg: TrainConfig, arrays: Arrays) -> None:
    """Build the model on the meta device and push one batch through: no memory, no compute."""
    shape = (2, arrays.in_channels, arrays.image_size, arrays.image_size)
    try:
        with torch.device("meta"):
            model = build_model(cfg.model, arrays.num_classes, arrays.in_channels, arrays.image_size, cfg.width)
            model(torch.empty(shape))
    except (ValueError, RuntimeError) as exc:
        raise _OptionError(
            f"--model {cfg.model} --width {cfg.width:g} does not fit the data "
            f"({arrays.in_channels}x{arrays.image_size}x{arrays.image_size} images): {exc}"
        ) from None


def _prepare_out(out: str | None, cfg: TrainConfig) -> Path:
    """Create (or, with --resume, find) the run directory and prove it is writable."""
    run_dir = Path(out) if out else Path("runs") / f"{time.strftime('%Y%m%d-%H%M%S')}-{cfg.model}-{cfg.compressor}"
    if cfg.resume:
        if not run_dir.is_dir():
            raise _OptionError(f"--out {run_dir}: no such run directory to resume")
    elif (run_dir / RECORDS_FILE).exists() or checkpoint.checkpoint_dir(run_dir).exists():
        raise _OptionError(
            f"--out {run_dir} already holds a run; pass --resume to continue it, or choose another directory"
        )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as exc:
        raise _OptionError(f"--out {run_dir}: cannot write there ({exc.strerror or exc})") from None
    return run_dir


# -- entry point --------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> None:
    cfg, notes = parse_config(argv)
    for note in notes:
        print(note)
    run_dir = Path(str(cfg.out))
    config = cfg.save(run_dir)
    launcher = build_parser().parse_known_args(argv)[0]
    if launcher.prepare_only:
        print(f"flexcomm-train: wrote {config}; on every node (with {run_dir} on a shared file system):\n"
              f"  torchrun --nnodes NODES --nproc-per-node PER_NODE --rdzv-backend c10d --rdzv-endpoint HOST:PORT "
              f"--rdzv-id JOB --max-restarts 3 -m flexcomm.train.worker {config}")
        return
    network = "plain loopback" if cfg.net == "none" else f"emulated network {cfg.net}"
    print(f"flexcomm-train: {cfg.nproc} rank(s) over {network}; run directory {run_dir}", flush=True)
    try:
        run_job(cfg, run_dir, max_restarts=launcher.max_restarts)
    except RankFailed as exc:
        raise SystemExit(f"flexcomm-train: {exc}") from None
    except KeyboardInterrupt:
        raise SystemExit("flexcomm-train: interrupted; all ranks were stopped") from None
    print(f"flexcomm-train: records in {run_dir / RECORDS_FILE}, summary in {run_dir / 'summary.json'}")
    if cfg.report:
        _report(run_dir)


def _report(run_dir: Path) -> None:
    from flexcomm.train.report import write_report  # matplotlib: imported only once there is a run to plot

    written = write_report([run_dir], run_dir)
    print("flexcomm-train: report: " + ", ".join(str(p) for p in written))


def _factor_rank(args: argparse.Namespace) -> int | None:
    """The factors' rank of PowerSGD (PyTorch's default 1) or of flexcomm's lowrank (its default); else None."""
    if args.compressor == "powersgd":
        return args.powersgd_rank or 1
    if args.compressor == "lowrank":
        return args.powersgd_rank or DEFAULT_RANK
    return None


if __name__ == "__main__":
    main(sys.argv[1:])

