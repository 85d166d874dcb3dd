"""The cluster's side of the user-space delay switch: start it, command it, stop it.

Where the kernel has no ``netem`` qdisc, :mod:`flexcomm.netem.delay` runs as a separate
process in the bridge namespace in place of the kernel bridge. It reads every frame from
the bridge-side veths, holds it for the sending host's delay and writes it to the
destination's port (whose tbf still shapes the download). It runs at SCHED_FIFO priority
so its timers fire on time on a busy machine.

Protocol: one command line on the switch's stdin, one reply line on its stdout (``ok ...``
or ``error ...``); ``ready {json}`` once on start. Replies are read from the raw pipe with
``select``, so no call blocks past its timeout. The switch runs in its own session (a
Ctrl-C meant for the job must not take the network down under it) and exits by itself
when its stdin closes, so it cannot outlive the process that started it.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from typing import IO, Any

from flexcomm.launch import stop_processes

from .commands import NetemCommandError, absolute_program

__all__ = ["DelaySwitch"]

log = logging.getLogger("flexcomm.netem")

#: Seconds to wait for the delay switch to start / to answer a command.
_START_TIMEOUT = 30.0
_REPLY_TIMEOUT = 10.0


class DelaySwitch:
    """One running delay switch process between ``ports`` (bridge-side veths, in host order)."""

    def __init__(self, ip: str, netns: str, ports: list[str], delay_s: float, jitter_s: float, priority: int) -> None:
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "delay.py")
        # ``python -I``: isolated mode keeps the package directory off sys.path; the script
        # needs only the standard library (importing flexcomm would import torch).
        argv = [
            ip, "netns", "exec", netns, absolute_program(sys.executable or "python3"), "-I", script,
            *(arg for port in ports for arg in ("--port", port)),
            "--delay", repr(delay_s), "--jitter", repr(jitter_s), "--realtime", str(priority),
        ]  # fmt: skip
        self._stderr: IO[bytes] | None = tempfile.TemporaryFile()
        self._buf = b""
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, start_new_session=True
        )
        try:
            line = self._readline(_START_TIMEOUT)
            if not line.startswith("ready"):
                raise RuntimeError(f"unexpected first line {line!r}")
        except RuntimeError as exc:
            rc = self._proc.poll()
            self.stop()
            raise NetemCommandError(argv, -1 if rc is None else rc, str(exc)) from None
        log.info("netem: delay switch pid %d in %s", self._proc.pid, netns)

    @property
    def pid(self) -> int | None:
        """The switch's pid while it runs, else None."""
        return self._proc.pid if self._proc is not None and self._proc.poll() is None else None

    def _error_text(self) -> str:
        if self._stderr is None:
            return ""
        try:
            self._stderr.seek(0)
            return self._stderr.read().decode(errors="replace")[-2000:].strip()
        except (OSError, ValueError):
            return ""

    def _readline(self, timeout: float) -> str:
        """One reply line (raw fd + select: never blocks past ``timeout``)."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise RuntimeError(f"delay switch did not answer within {timeout:g}s")
            ready, _, _ = select.select([fd], [], [], remaining)
            if ready:
                chunk = os.read(fd, 65536)
                if not chunk:
                    raise RuntimeError(f"delay switch exited (rc={self._proc.poll()}): {self._error_text()}")
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line.decode(errors="replace")

    def command(self, line: str) -> str:
        """Send one control line; return its ``ok ...`` reply without ``ok`` (raise on ``error``)."""
        with self._lock:
            if self._proc is None or self._proc.stdin is None:
                raise RuntimeError("no delay switch running")
            try:
                self._proc.stdin.write(line.encode() + b"\n")
                self._proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError) as exc:
                raise RuntimeError(f"delay switch is gone ({exc}): {self._error_text()}") from None
            reply = self._readline(_REPLY_TIMEOUT)
        if not reply.startswith("ok"):
            raise RuntimeError(f"delay switch refused {line!r}: {reply}")
        return reply[2:].strip()

    def set_delay(self, host: int | None, delay_s: float, jitter_s: float) -> None:
        """Delay (and jitter) of what host ``host`` sends, or of every host."""
        self.command(f"delay {'*' if host is None else host} {delay_s!r} {jitter_s!r}")

    def stats(self) -> dict[str, Any]:
        """Counters (frames, bytes, drops, timer lateness, per port)."""
        return dict(json.loads(self.command("stats")))

    def stop(self, grace_s: float = 2.0) -> None:
        """SIGTERM, then SIGKILL (idempotent; safe from a signal handler)."""
        proc, self._proc = self._proc, None
        if proc is not None:
            try:
                rc = proc.poll()
                if rc is not None:  # it died while the cluster was up: say so (its traffic stopped then)
                    log.error("netem: the delay switch had exited (rc=%s): %s", rc, self._error_text())
                else:
                    stop_processes([proc], grace_s)
            finally:
                for stream in (proc.stdin, proc.stdout):
                    try:
                        if stream is not None:
                            stream.close()
                    except OSError:
                        pass
        if self._stderr is not None:
            try:
                self._stderr.close()
            except OSError:
                pass
            self._stderr = None
