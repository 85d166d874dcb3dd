"""Measure raw TCP throughput through an EmulatedCluster link (root only).

Why: tbf's accuracy depends on the burst size chosen per rate; this checks the
shaped rate is what TCP actually gets, from 10 Mbit/s to 10 Gbit/s. It is a
measurement, not a test: numbers depend on machine load.

    sudo .venv/bin/python benchmarks/netem_check.py --rates 10mbit,100mbit,1gbit --seconds 3

Host 1 runs a receiver, host 0 a sender; the receiver reports goodput over the
whole transfer and over the part after ``--skip`` seconds (steady state, after
the initial token-bucket burst and slow start). Expect ~94-95% of the link
rate at MTU 1500 (TCP/IP header overhead), e.g. 954 Mbit/s at 1gbit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from flexcomm.netem import EmulatedCluster, netem_available, parse_rate

PORT = 29517

RECEIVER = r"""
import json, socket, sys, time
addr, port, skip = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind((addr, port)); srv.listen(1); srv.settimeout(30)
print("ready", flush=True)
conn, _ = srv.accept(); conn.settimeout(30)
buf = bytearray(1 << 20); total = 0; t_first = None; after = 0; t_skip = None
while True:
    n = conn.recv_into(buf)
    now = time.monotonic()
    if n == 0:
        break
    if t_first is None:
        t_first = now
    total += n
    if now - t_first >= skip:
        if t_skip is None:
            t_skip = now
        else:
            after += n
t_end = time.monotonic()
print(json.dumps({"bytes": total, "seconds": t_end - t_first, "steady_bytes": after,
                  "steady_seconds": (t_end - t_skip) if t_skip else 0.0}), flush=True)
"""

SENDER = r"""
import socket, sys, time
addr, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.create_connection((addr, port), timeout=30)
chunk = b"\0" * (1 << 20); end = time.monotonic() + seconds
while time.monotonic() < end:
    s.sendall(chunk)
s.close()
"""


def measure(rate: str, seconds: float, skip: float) -> dict[str, float]:
    """One transfer host0 -> host1 at ``rate``; returns Mbit/s figures."""
    with EmulatedCluster(2, rate, prefix="fcb") as cluster:
        dst = cluster.host_addr(1)
        rx = cluster.popen(1, [sys.executable, "-c", RECEIVER, dst, str(PORT), str(skip)], stdout=subprocess.PIPE, text=True)
        assert rx.stdout is not None
        if rx.stdout.readline().strip() != "ready":
            raise RuntimeError("receiver did not start")
        tx = cluster.popen(0, [sys.executable, "-c", SENDER, dst, str(PORT), str(seconds)])
        tx.wait(seconds + 60)
        result = json.loads(rx.communicate(timeout=60)[0])
    link = parse_rate(rate) / 1e6
    mbit = result["bytes"] * 8 / result["seconds"] / 1e6
    steady = result["steady_bytes"] * 8 / result["steady_seconds"] / 1e6 if result["steady_seconds"] else float("nan")
    return {"link_mbit": link, "mbit": mbit, "steady_mbit": steady, "ratio": steady / link}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rates", default="100mbit,1gbit", help="comma-separated tc rates")
    parser.add_argument("--seconds", type=float, default=3.0, help="sending time per rate")
    parser.add_argument("--skip", type=float, default=0.5, help="seconds excluded from the steady figure")
    args = parser.parse_args()
    ok, reason = netem_available()
    if not ok:
        print(f"skipped: {reason}")
        return 0
    for rate in args.rates.split(","):
        t0 = time.monotonic()
        r = measure(rate.strip(), args.seconds, args.skip)
        print(
            f"{rate:>9}: overall {r['mbit']:8.1f} Mbit/s, steady {r['steady_mbit']:8.1f} Mbit/s "
            f"({100 * r['ratio']:.1f}% of link), {time.monotonic() - t0:.1f}s wall",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
