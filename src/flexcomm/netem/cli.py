"""``flexcomm-netem``: run any distributed training command with each rank on its own emulated host.

    flexcomm-netem --nproc 2 --net 1gbit:30s,100mbit/5ms:30s,300mbit -- python train.py --epochs 3

Rank ``i`` runs ``CMD ARGS...`` inside host ``i`` of an :class:`EmulatedCluster` (its own
network namespace and shaped link) with torchrun's environment (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``, ``GLOO_SOCKET_IFNAME``,
``NCCL_SOCKET_IFNAME``; see :mod:`flexcomm.launch`), so a script that calls
``dist.init_process_group(backend)`` needs no change. The schedule (the syntax of
``flexcomm-train --net``) starts with the ranks; every rate change really applied can be
written to a file as JSON lines. Rank output is prefixed ``[rank i]``. On exit, on a failed
rank and on Ctrl-C every rank is stopped and the emulated network removed.

Needs root and the ``ip``/``tc`` tools; without them it says so and stops, unless
``--loopback`` asks for plain loopback ranks (no emulation, the schedule is not applied).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from collections.abc import Callable
from typing import IO

from flexcomm.launch import RankFailed, run_ranks

from .cleanup import cleanup_stale
from .cluster import EmulatedCluster
from .commands import netem_available
from .runner import RateChange
from .schedule import SCHEDULE_FORMAT, Phase, describe_phases, parse_schedule
from .topology import MAX_HOSTS

__all__ = ["main", "build_parser"]

PROG = "flexcomm-netem"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        usage=f"{PROG} --nproc N --net SCHEDULE [options] -- CMD [ARGS...]",
        description="Run a distributed training command with each rank on its own emulated host "
        "(network namespace + shaped link), with torchrun's environment variables.",
    )
    parser.add_argument("--nproc", type=int, required=True, help=f"number of ranks, one per host (1..{MAX_HOSTS})")
    parser.add_argument("--net", required=True, metavar="SCHEDULE", help=f"link schedule: {SCHEDULE_FORMAT}")
    parser.add_argument("--log-changes", metavar="PATH",
                        help="append each rate change applied as a JSON line (time_s, unix_time, rate_bps, delay_s, "
                        "jitter_s)")  # fmt: skip
    parser.add_argument("--loopback", action="store_true",
                        help="run the ranks on plain loopback instead (no root needed; the schedule is NOT applied)")
    parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                        help="stop every rank after this long (default: no limit)")  # fmt: skip
    parser.add_argument("--max-restarts", type=int, default=0, metavar="K",
                        help="restart the whole group up to K times after a rank fails (TORCHELASTIC_RESTART_COUNT)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD ARGS...: what every rank runs")
    return parser


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[Phase]]:
    parser = build_parser()
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command every rank runs after '--', e.g. -- python train.py")
    args.command = command
    if not 1 <= args.nproc <= MAX_HOSTS:
        parser.error(f"--nproc must be in 1..{MAX_HOSTS} (one emulated host per rank), got {args.nproc}")
    if args.timeout is not None and args.timeout <= 0:
        parser.error(f"--timeout must be > 0 seconds, got {args.timeout:g}")
    if args.max_restarts < 0:
        parser.error(f"--max-restarts must be >= 0, got {args.max_restarts}")
    try:
        phases = parse_schedule(args.net)
    except ValueError as exc:
        parser.error(f"--net: {exc}")
    if not phases and not args.loopback:
        parser.error("--net: give a schedule to emulate (e.g. --net 100mbit/5ms), or --loopback for no emulation")
    return args, phases


def _change_logger(stream: IO[str]) -> Callable[[RateChange], None]:
    """Writes each applied change as one JSON line, flushed at once (the job may be killed)."""

    def log_change(change: RateChange) -> None:
        line = {"time_s": change.time_s, "unix_time": time.time(), "rate_bps": change.rate_bps,
                "delay_s": change.delay_s, "jitter_s": change.jitter_s}  # fmt: skip
        stream.write(json.dumps(line) + "\n")
        stream.flush()

    return log_change


def _say(message: str) -> None:
    print(f"{PROG}: {message}", file=sys.stderr, flush=True)


def _run(args: argparse.Namespace, phases: list[Phase]) -> None:
    common = {"timeout": args.timeout, "output": "prefix", "max_restarts": args.max_restarts}
    if args.loopback:
        _say(f"--loopback: {args.nproc} rank(s) on plain loopback; the schedule is NOT applied")
        run_ranks(None, args.nproc, args.command, **common)
        return
    ok, reason = netem_available()
    if not ok:
        raise SystemExit(
            f"{PROG}: cannot emulate hosts here: {reason}.\n{PROG} needs root and the 'ip' and 'tc' tools "
            "(iproute2) to create network namespaces and shape links: run it as root (e.g. with sudo), or pass "
            "--loopback to run the ranks on plain loopback without emulation."
        )
    cleanup_stale()  # namespaces of dead earlier runs only
    with contextlib.ExitStack() as stack:
        log_file = stack.enter_context(open(args.log_changes, "a", encoding="utf-8")) if args.log_changes else None
        cluster = stack.enter_context(EmulatedCluster(args.nproc, phases))
        _say(f"{args.nproc} rank(s), host i at 10.99.0.(i+1); network: {describe_phases(phases)}")
        runner = stack.enter_context(cluster.start_schedule(on_change=_change_logger(log_file) if log_file else None))
        run_ranks(cluster, args.nproc, args.command, **common)
        runner.stop()  # raises if a rate change failed: the command did not see its schedule


def main(argv: list[str] | None = None) -> None:
    """Console entry point; exits with the failed rank's status (128 + signal if it was killed)."""
    args, phases = _parse(argv)
    try:
        _run(args, phases)
    except RankFailed as exc:
        _say(str(exc))
        code = exc.returncode
        raise SystemExit(1 if code is None else (128 - code if code < 0 else code)) from None
    except OSError as exc:  # the command or the --log-changes file
        raise SystemExit(f"{PROG}: {exc}") from None
    except KeyboardInterrupt:
        _say("interrupted; every rank was stopped and the emulated network removed")
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
