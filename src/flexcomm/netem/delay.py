"""User-space L2 switch with a per-port delay line (for kernels without ``netem``).

``EmulatedCluster`` starts this as a separate process inside its bridge
namespace when a delay is asked for and the kernel has no ``netem`` qdisc::

    ip netns exec <bridge ns> python -I .../flexcomm/netem/delay.py --port <b0> --port <b1> ...

(``python -m flexcomm.netem.delay`` works too, but imports the flexcomm
package, and with it torch.) It replaces the kernel bridge: one ``AF_PACKET``
socket per bridge-side veth port receives every frame the host on that port
sends, holds it for that port's one-way delay and then writes it to the port
of its destination MAC (learned from source addresses; broadcast, multicast
and unknown destinations are flooded). Port ``i`` is host ``i``'s link: its
delay applies to the frames host ``i`` *sends*, so host A -> host B sees
exactly A's delay, as with ``netem`` on a host's egress.

How it holds the numbers (measured by ``benchmarks/latency.py``):

* ``PACKET_VNET_HDR`` on every socket: frames arrive with a ``virtio_net_hdr``
  describing GSO (TSO super-packets up to 64 KiB) and partial checksums, and
  are sent on with the same header, so the kernel rebuilds the same skb on
  the output port. TCP keeps its normal MTU/MSS (1500/1448) while the switch
  moves up to 64 KiB per frame: ~2000 frames/s at 1 Gbit/s.
* Arrival time is the kernel's software receive timestamp
  (``SO_TIMESTAMPING``), taken when the frame reached the socket, so the time
  this process needs to wake up and read it is part of the delay rather than
  added to it.
* One thread, one heap: release time = arrival + delay (+ uniform jitter in
  ``[-jitter, +jitter]``, clipped at 0). Without jitter the release time is
  also clamped to be >= the previous frame's from the same port, so frames
  never overtake each other, even when the delay is lowered mid-run; with
  jitter they may reorder, as with ``netem``.
* Never early, rarely late: ``select`` takes microsecond timeouts, the timer
  slack is 1 ns, and the process sets its timer to wake up early by its own
  measured wake-up latency, then polls for the last few microseconds.
  ``EmulatedCluster`` runs it at a SCHED_FIFO priority so a busy machine does
  not delay its timers.
* No shaping here: ``tbf`` stays on the host-side veths (upload) and on the
  bridge-side ports (download, applied as this process writes to them).

Control channel: one command per line on stdin, one reply line on stdout
(``ok ...`` or ``error ...``)::

    delay <port|*> <delay_s> [<jitter_s>]   set the delay (and jitter) of one or all ports
    stats                                   reply ``ok {json counters}``
    quit                                    exit (EOF on stdin does the same)

On start it prints ``ready {json}`` once every socket is bound. EOF on stdin
(the cluster's process died) ends it, so it cannot outlive its cluster.

Standard library only; Linux only; needs CAP_NET_RAW in the bridge namespace.
"""

from __future__ import annotations

import argparse
import ctypes
import errno
import heapq
import json
import os
import random
import select
import signal
import socket
import struct
import sys
import time

# <linux/if_ether.h>, <linux/if_packet.h>, <asm-generic/socket.h>, <linux/net_tstamp.h>, <linux/prctl.h>
ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_STATISTICS = 6
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
SO_RCVBUFFORCE = 33
SO_SNDBUFFORCE = 32
SO_TIMESTAMPING = 37  # also SCM_TIMESTAMPING
SOF_TIMESTAMPING_RX_SOFTWARE = 1 << 3
SOF_TIMESTAMPING_SOFTWARE = 1 << 4
PR_SET_TIMERSLACK = 29

VNET_HDR_LEN = 10  # struct virtio_net_hdr
ETH_HLEN = 14
#: Largest frame read: a 64 KiB GSO packet plus headers (BIG TCP is not enabled on the veths).
MAX_FRAME = 256 * 1024
#: Frames read from one socket before timers are looked at again.
BATCH = 32
#: Timer wake-up latency estimate: EWMA gain, and cap of one sample.
WAKE_EST_GAIN = 0.05
WAKE_EST_MAX = 500e-6
#: A kernel timestamp older than this (or in the future) is not trusted; "now" is used.
TSTAMP_MAX_AGE_S = 1.0
MAX_DELAY_S = 3600.0
_TIMESPEC = struct.Struct("@qq")
_CMSG_SPACE = socket.CMSG_SPACE(3 * _TIMESPEC.size)  # struct scm_timestamping: ts[3]


def release_time(arrival: float, delay: float, jitter: float, last_release: float, rng: random.Random) -> float:
    """When a frame that arrived at ``arrival`` leaves the switch.

    Without jitter: ``arrival + delay``, but never before the previous frame
    from the same port (``last_release``), so a lowered delay cannot reorder
    frames. With jitter: ``arrival + delay + U(-jitter, +jitter)``, clipped so
    the frame never leaves before it arrived; frames may then reorder.
    """
    if jitter > 0:
        return arrival + max(0.0, delay + rng.uniform(-jitter, jitter))
    return max(arrival + delay, last_release)


class Port:
    """One bridge-side veth: its socket, delay settings and counters."""

    __slots__ = (
        "index", "name", "sock", "fd", "delay", "jitter", "last_release",
        "rx", "rx_bytes", "tx", "tx_bytes", "drops", "kernel_drops", "truncated",
    )  # fmt: skip

    def __init__(self, index: int, name: str, rcvbuf: int, sndbuf: int, kernel_timestamps: bool = True) -> None:
        self.index = index
        self.name = name
        # Protocol 0 at creation: the socket receives nothing until bound to this one device.
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0)
        sock.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
        # Without this the socket would also read back every frame we send on this port.
        sock.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)  # Linux >= 4.20
        if kernel_timestamps:
            # Software receive timestamps: when the frame reached this socket (in the
            # sender's softirq), not when this process got round to reading it.
            sock.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPING, SOF_TIMESTAMPING_RX_SOFTWARE | SOF_TIMESTAMPING_SOFTWARE)
        for opt, force, size in ((socket.SO_RCVBUF, SO_RCVBUFFORCE, rcvbuf), (socket.SO_SNDBUF, SO_SNDBUFFORCE, sndbuf)):
            try:
                sock.setsockopt(socket.SOL_SOCKET, force, size)  # root: above net.core.*mem_max
            except OSError:
                sock.setsockopt(socket.SOL_SOCKET, opt, size)
        sock.bind((name, ETH_P_ALL))
        sock.setblocking(False)
        self.sock = sock
        self.fd = sock.fileno()
        self.delay = 0.0
        self.jitter = 0.0
        self.last_release = 0.0
        self.rx = self.rx_bytes = self.tx = self.tx_bytes = self.drops = self.kernel_drops = self.truncated = 0

    def poll_kernel_drops(self) -> None:
        """Add the kernel's count of frames dropped on a full receive buffer (reading resets it)."""
        try:
            _packets, drops = struct.unpack("II", self.sock.getsockopt(SOL_PACKET, PACKET_STATISTICS, 8))
            self.kernel_drops += drops
        except OSError:
            pass


class Switch:
    """The learning switch plus delay line; :meth:`run` is the event loop.

    ``ports`` may be empty (then nothing is opened: the control commands can be
    exercised without privileges).
    """

    def __init__(self, ports: list[str], rcvbuf: int = 32 << 20, sndbuf: int = 64 << 20,
                 seed: int | None = None, kernel_timestamps: bool = True) -> None:  # fmt: skip
        self.ports = [Port(i, name, rcvbuf, sndbuf, kernel_timestamps) for i, name in enumerate(ports)]
        self.by_fd = {p.fd: p for p in self.ports}
        self.macs: dict[bytes, int] = {}
        self.heap: list[tuple[float, int, int, bytes]] = []  # (release, seq, source port, frame)
        self.seq = 0
        self.rng = random.Random(seed)
        self.flooded = 0
        self.unroutable = 0
        self.released = 0
        self.late_sum = 0.0
        self.late_max = 0.0
        self.queued_max = 0
        self.wake_est = 0.0
        self.stdin_buf = b""
        self.running = True
        self.t_start = time.monotonic()

    # -- control ---------------------------------------------------------------
    def set_delay(self, which: str, delay: float, jitter: float) -> None:
        if not (0 <= delay <= MAX_DELAY_S and 0 <= jitter <= MAX_DELAY_S):  # also rejects NaN
            raise ValueError(f"delay and jitter must be in [0, {MAX_DELAY_S:g}] s, got {delay!r}, {jitter!r}")
        if which == "*":
            targets = self.ports
        else:
            index = int(which)
            if not 0 <= index < len(self.ports):
                raise ValueError(f"no port {index} (ports 0..{len(self.ports) - 1})")
            targets = [self.ports[index]]
        for p in targets:
            p.delay, p.jitter = delay, jitter

    def stats(self) -> dict[str, object]:
        for p in self.ports:
            p.poll_kernel_drops()
        return {
            "uptime_s": time.monotonic() - self.t_start,
            "queued": len(self.heap),
            "queued_max": self.queued_max,
            "flooded": self.flooded,
            "unroutable": self.unroutable,
            "released": self.released,
            "late_mean_s": self.late_sum / self.released if self.released else 0.0,
            "late_max_s": self.late_max,
            "wake_latency_est_s": self.wake_est,
            "ports": [
                {"name": p.name, "delay_s": p.delay, "jitter_s": p.jitter, "rx": p.rx, "rx_bytes": p.rx_bytes,
                 "tx": p.tx, "tx_bytes": p.tx_bytes, "drops": p.drops, "kernel_drops": p.kernel_drops,
                 "truncated": p.truncated}  # fmt: skip
                for p in self.ports
            ],
        }

    def command(self, line: str) -> str:
        """Execute one control line; return the reply line (without newline)."""
        parts = line.split()
        try:
            if parts and parts[0] == "delay" and len(parts) in (3, 4):
                jitter = float(parts[3]) if len(parts) == 4 else 0.0
                self.set_delay(parts[1], float(parts[2]), jitter)
                return f"ok delay {parts[1]} {float(parts[2])!r} {jitter!r}"
            if parts == ["stats"]:
                return "ok " + json.dumps(self.stats())
            if parts == ["quit"]:
                self.running = False
                return "ok quit"
        except ValueError as exc:
            return f"error {exc}"
        return f"error unknown command {line.strip()!r}"

    def read_control(self) -> None:
        try:
            chunk = os.read(0, 4096)
        except BlockingIOError:
            return
        if not chunk:  # EOF: the cluster closed the pipe, or its process is gone
            self.running = False
            return
        self.stdin_buf += chunk
        while b"\n" in self.stdin_buf:
            raw, self.stdin_buf = self.stdin_buf.split(b"\n", 1)
            sys.stdout.write(self.command(raw.decode(errors="replace")) + "\n")
            sys.stdout.flush()

    # -- data path ---------------------------------------------------------------
    def receive(self, port: Port) -> None:
        """Read up to BATCH frames from ``port`` and queue each for its release time."""
        sock = port.sock
        now = time.monotonic()
        real_minus_mono = time.time() - now
        heap = self.heap
        for _ in range(BATCH):
            try:
                frame, anc, flags, _addr = sock.recvmsg(MAX_FRAME, _CMSG_SPACE)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                if exc.errno in (errno.ENETDOWN, errno.ENXIO):
                    break
                raise
            if flags & socket.MSG_TRUNC:
                port.truncated += 1
                continue
            if len(frame) < VNET_HDR_LEN + ETH_HLEN:
                continue
            arrival = now
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == SO_TIMESTAMPING and len(data) >= _TIMESPEC.size:
                    sec, nsec = _TIMESPEC.unpack_from(data)
                    stamp = sec + nsec * 1e-9 - real_minus_mono
                    if now - TSTAMP_MAX_AGE_S < stamp <= now:
                        arrival = stamp
            port.rx += 1
            port.rx_bytes += len(frame) - VNET_HDR_LEN
            src_mac = frame[VNET_HDR_LEN + 6 : VNET_HDR_LEN + 12]
            if not src_mac[0] & 1:
                self.macs[src_mac] = port.index
            release = release_time(arrival, port.delay, port.jitter, port.last_release, self.rng)
            port.last_release = release
            self.seq += 1
            heapq.heappush(heap, (release, self.seq, port.index, frame))
        if len(heap) > self.queued_max:
            self.queued_max = len(heap)

    def forward(self, src: int, frame: bytes) -> None:
        """Send ``frame`` to its destination port, or flood it."""
        dst_mac = frame[VNET_HDR_LEN : VNET_HDR_LEN + 6]
        dst = None if dst_mac[0] & 1 else self.macs.get(dst_mac)
        if dst is None:
            outs = [p for p in self.ports if p.index != src]
            self.flooded += 1
        elif dst == src:
            self.unroutable += 1
            return
        else:
            outs = [self.ports[dst]]
        for out in outs:
            try:
                out.sock.send(frame)
                out.tx += 1
                out.tx_bytes += len(frame) - VNET_HDR_LEN
            except OSError:
                # ENOBUFS: the port's tbf queue is full (a real switch drops too); ENETDOWN...
                out.drops += 1

    def release_due(self) -> float | None:
        """Send every frame whose time has come; return seconds until the next one (None if idle)."""
        heap = self.heap
        while heap:
            now = time.monotonic()
            release = heap[0][0]
            if release > now:
                return release - now
            _, _, src, frame = heapq.heappop(heap)
            late = now - release
            self.late_sum += late
            if late > self.late_max:
                self.late_max = late
            self.released += 1
            self.forward(src, frame)
        return None

    def run(self) -> None:
        fds = [0] + [p.fd for p in self.ports]
        by_fd = self.by_fd
        while self.running:
            wait = self.release_due()
            sleep = None if wait is None else max(0.0, wait - self.wake_est)  # 0: poll until due
            target = time.monotonic() + sleep if sleep else 0.0
            try:
                ready, _, _ = select.select(fds, [], [], sleep)
            except InterruptedError:
                continue
            if not ready and sleep:
                # Woken by the timer alone: learn how late such wake-ups are (EWMA, outliers capped).
                late = min(max(time.monotonic() - target, 0.0), WAKE_EST_MAX)
                self.wake_est += WAKE_EST_GAIN * (late - self.wake_est)
            for fd in ready:
                if fd == 0:
                    self.read_control()
                else:
                    self.receive(by_fd[fd])


def _set_timer_slack() -> None:
    """1 ns timer slack: sleeps end when asked, not up to 50 us later (the default)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0), ctypes.c_ulong(0))
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="User-space L2 switch with a per-port delay line (see module doc).")
    parser.add_argument("--port", action="append", required=True, help="bridge-side device; repeat, in host order")
    parser.add_argument("--delay", type=float, default=0.0, help="initial one-way delay of every port (s)")
    parser.add_argument("--jitter", type=float, default=0.0, help="initial jitter of every port (s)")
    parser.add_argument("--rcvbuf", type=int, default=32 << 20, help="socket receive buffer per port (bytes)")
    parser.add_argument("--sndbuf", type=int, default=64 << 20, help="socket send buffer per port (bytes)")
    parser.add_argument("--realtime", type=int, default=0, help="SCHED_FIFO priority (0 = normal scheduling)")
    parser.add_argument("--seed", type=int, default=None, help="jitter RNG seed")
    parser.add_argument("--no-kernel-timestamps", action="store_true", help="time frames when read, not on arrival")
    args = parser.parse_args(argv)

    # The cluster stops us with SIGTERM; SIGINT is not ours to act on (own session anyway).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_timer_slack()
    if args.realtime > 0:
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(args.realtime))
        except OSError as exc:  # e.g. a container without CAP_SYS_NICE: still correct, less precise
            sys.stderr.write(f"delay switch: running without real-time priority ({exc})\n")
    switch = Switch(args.port, args.rcvbuf, args.sndbuf, seed=args.seed, kernel_timestamps=not args.no_kernel_timestamps)
    switch.set_delay("*", args.delay, args.jitter)
    os.set_blocking(0, False)
    sys.stdout.write("ready " + json.dumps({"pid": os.getpid(), "ports": args.port}) + "\n")
    sys.stdout.flush()
    try:
        switch.run()
    finally:
        for p in switch.ports:
            p.sock.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
