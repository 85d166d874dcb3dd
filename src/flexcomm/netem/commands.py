"""Thin, explicit wrappers around ``ip`` and ``tc``.

Everything here either builds an argv (pure, unit-testable without root) or
runs one with ``subprocess.run(..., check=True, capture_output=True)`` and
turns a failure into :class:`NetemCommandError` carrying tc/ip's stderr,
because "exit status 2" alone never says which link or option was wrong.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
from collections.abc import Sequence

from .schedule import format_rate

__all__ = [
    "NetemUnavailable",
    "NetemCommandError",
    "netem_available",
    "require_netem",
    "tool_path",
    "run_cmd",
    "tbf_burst_bytes",
    "tbf_args",
    "netem_delay_args",
    "absolute_program",
    "TBF_LATENCY_MS",
]

#: tbf's queue bound expressed as time; 50 ms is what MACHINE-NOTES measured
#: as accurate and it keeps queueing delay far below gloo's timeouts.
TBF_LATENCY_MS = 50

#: Burst = this much line-rate time, so the bucket refills in small steps
#: relative to a transfer at any rate (2 ms at 1 Gbit = 250 kB, close to the
#: 256 kB measured as accurate on this machine).
_BURST_SECONDS = 0.002
#: ...but never below a whole 64 KiB GSO packet plus the per-segment headers tbf counts.
#: tbf splits a packet larger than its bucket only when it is enqueued: one queued at a
#: high rate (large bucket) and still queued when a schedule lowers the rate to a bucket
#: smaller than itself can never be sent, and the link stalls for good (seen at 1 Gbit ->
#: 100 Mbit with a 32 KiB bucket: 338 packets stuck, gloo waiting in TCP back-off).
_MIN_BURST_BYTES = 80_000


class NetemUnavailable(RuntimeError):
    """Network emulation cannot run here (not root, no ``ip``/``tc``, no netns)."""


class NetemCommandError(RuntimeError):
    """An ``ip``/``tc`` command failed; the message includes its argv and stderr."""

    def __init__(self, argv: Sequence[str], returncode: int, stderr: str) -> None:
        self.argv = list(argv)
        self.returncode = returncode
        self.stderr = stderr
        super().__init__(
            f"command failed (exit {returncode}): {' '.join(self.argv)}\n  stderr: {stderr.strip()}"
        )


def tool_path(name: str) -> str:
    """Absolute path of ``ip``/``tc``; also searches sbin dirs missing from PATH."""
    search = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin:/usr/bin:/bin"
    path = shutil.which(name, path=search)
    if path is None:
        raise NetemUnavailable(
            f"the {name!r} binary was not found (install iproute2); "
            "flexcomm.netem needs both 'ip' and 'tc'"
        )
    return path


def run_cmd(argv: Sequence[str], timeout: float = 30.0, stdin: str | None = None) -> str:
    """Run ``argv`` (fed ``stdin``); return stdout, raise NetemCommandError (with stderr) on failure."""
    try:
        done = subprocess.run(list(argv), check=True, capture_output=True, text=True, timeout=timeout, input=stdin)
    except subprocess.CalledProcessError as exc:
        raise NetemCommandError(argv, exc.returncode, exc.stderr or "") from None
    except subprocess.TimeoutExpired as exc:
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
        raise NetemCommandError(argv, -1, f"timed out after {timeout}s; {stderr}") from None
    return done.stdout


def _missing_reason() -> str | None:
    """Why emulation cannot work here, or None if the static requirements hold."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "creating network namespaces and qdiscs needs root (CAP_NET_ADMIN + CAP_SYS_ADMIN)"
    for name in ("ip", "tc"):
        try:
            tool_path(name)
        except NetemUnavailable as exc:
            return str(exc)
    return None


@functools.lru_cache(maxsize=1)
def netem_available() -> tuple[bool, str]:
    """Return ``(True, "ok")`` if EmulatedCluster can run here, else ``(False, reason)``.

    Besides root and the binaries, it really creates and deletes a scratch
    namespace, because containers often run as root without the capabilities
    needed for ``ip netns add``. Cached: the answer does not change in-process.
    """
    reason = _missing_reason()
    if reason is not None:
        return False, reason
    probe = f"fcprobe{os.getpid()}"
    ip = tool_path("ip")
    try:
        run_cmd([ip, "netns", "add", probe], timeout=10)
    except NetemCommandError as exc:
        return False, f"'ip netns add' does not work here: {exc.stderr.strip()}"
    try:
        run_cmd([ip, "netns", "delete", probe], timeout=10)
    except NetemCommandError as exc:
        return False, f"'ip netns delete' does not work here: {exc.stderr.strip()}"
    return True, "ok"


def require_netem() -> None:
    """Raise NetemUnavailable with the reason if emulation cannot run here."""
    ok, reason = netem_available()
    if not ok:
        raise NetemUnavailable(f"network emulation unavailable: {reason}")


def tbf_burst_bytes(rate_bps: float) -> int:
    """Token-bucket size for ``rate_bps``: 2 ms of line rate, at least 32 KiB.

    A fixed burst is wrong at one end of 10 Mbit-10 Gbit: 256 kB is 0.2 s of
    free sending at 10 Mbit (inaccurate for short transfers), yet only 0.2 ms at
    10 Gbit (the qdisc watchdog must then wake every 0.2 ms to keep up).
    """
    return max(_MIN_BURST_BYTES, int(rate_bps / 8.0 * _BURST_SECONDS))


def tbf_args(rate_bps: float) -> list[str]:
    """The ``tbf ...`` tail of a tc command, with burst/latency sized for the rate.

    ``tc qdisc change`` needs burst and latency restated every time, so every
    caller uses this one builder for both ``add`` and ``change``.
    """
    return [
        "tbf",
        "rate",
        format_rate(rate_bps),
        "burst",
        str(tbf_burst_bytes(rate_bps)),
        "latency",
        f"{TBF_LATENCY_MS}ms",
    ]


def netem_delay_args(delay_s: float, jitter_s: float = 0.0) -> list[str]:
    """``netem delay D [J]`` (microseconds); netem's jitter is uniform in D +- J by default."""
    args = ["netem", "delay", f"{max(0, int(round(delay_s * 1e6)))}us"]
    if jitter_s > 0:
        args.append(f"{max(1, int(round(jitter_s * 1e6)))}us")
    return args


def absolute_program(program: str) -> str:
    """Make argv[0] absolute: ``ip netns exec`` failed with a relative interpreter path.

    ``os.path.abspath`` (not ``realpath``) keeps a venv's ``bin/python`` symlink intact,
    which is how Python finds the venv.
    """
    if os.path.isabs(program):
        return program
    if os.sep in program:
        return os.path.abspath(program)
    found = shutil.which(program)
    if found is None:
        raise FileNotFoundError(f"program {program!r} not found on PATH")
    return os.path.abspath(found)
