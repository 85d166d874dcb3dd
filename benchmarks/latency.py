"""Measure the emulated network's delay: accuracy, throughput under delay, change latency (root only).

    sudo .venv/bin/python benchmarks/latency.py            # ~3-4 minutes
    sudo .venv/bin/python benchmarks/latency.py --quick    # fewer repetitions
    sudo .venv/bin/python benchmarks/latency.py --quick --no-throughput   # parts 1 and 3 only, ~1 minute

Writes ``benchmarks/results/latency_*.csv`` and ``latency.png``. Two emulated
hosts run one gloo rank each (torch.distributed env:// rendezvous at
10.99.0.1, ``GLOO_SOCKET_IFNAME`` set by ``EmulatedCluster.popen``); this
process drives them over their stdin/stdout and changes the network between
measurements. Three parts:

1. Delay accuracy. Median time of a 1-float allreduce (back to back, on rank
   0) at one-way delays 0, 1, 5, 16, 32 ms. With delay d on every link the
   allreduce should take ``base + k * 2d`` where ``base`` is the 0 ms time and
   ``k`` the number of round trips the algorithm needs (reported: fitted and
   the integer it rounds to). Pass = within 10 % of ``k * 2d`` or 0.2 ms.
   The 0 ms time through the kernel bridge (no delay path) is reported too:
   the difference is what the user-space switch costs per allreduce. During
   parts 1 and 3 the ranks run at SCHED_FIFO priority ``--rank-priority``
   (below the switch's), so other load on a shared machine stays out of the
   delay figures; part 2 runs them at normal priority.
2. Throughput at 100 Mbit/s and 1 Gbit/s, delay 0 and 5 ms (and through the
   kernel bridge for reference): a 40 MB allreduce (10M floats; achieved
   rate = 40 MB * 8 / median time, the bytes each rank sends in a 2-rank ring
   allreduce), the same 40 MB as two concurrent 20 MB async allreduces (what
   DDP's gradient buckets do; ProcessGroupGloo runs two at a time), and one
   bulk TCP stream host 0 -> host 1 (``netem_check.py``'s sender/receiver).
   The CPU time of the switch process (utime + stime from /proc/<pid>/stat)
   is reported per configuration. gloo's ring allreduce keeps at most two
   1 MiB segments in flight, and each one first needs a "ready to receive"
   notice from the peer, so one allreduce moves at most ~2 MiB per round
   trip: on a 10 ms RTT that caps it well below the link rate, whatever the
   network emulator does.
3. Change latency. Rank 0 runs 1-float allreduces back to back while the
   delay alternates between 2 ms and 20 ms; for each change, the time from
   the ``set_delay`` call to the end of the first allreduce whose duration is
   past the midpoint between the old and the new expected time.

It is a measurement, not a test: on a shared 2-core machine the numbers move
by several percent between runs.
"""

from __future__ import annotations

import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import common
from flexcomm.launch import RankProcess, start_ranks, stop_ranks
from flexcomm.netem import EmulatedCluster, netem_available

PORT = 29651
MB40 = 10_000_000  # floats: 40 MB


# --------------------------------------------------------------------------
# Worker: one gloo rank inside an emulated host, driven over stdin/stdout.
# --------------------------------------------------------------------------
def worker() -> None:
    import datetime

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method="env://", timeout=datetime.timedelta(seconds=300))
    rank = dist.get_rank()

    def reply(obj: Any) -> None:
        sys.stdout.write("@@" + json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"ready": rank})
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "quit":
            break
        if cmd[0] == "prio":  # prio <n>: SCHED_FIFO n for every thread of this rank (0 = back to normal)
            n = int(cmd[1])
            policy, param = (os.SCHED_FIFO, os.sched_param(n)) if n > 0 else (os.SCHED_OTHER, os.sched_param(0))
            for tid in os.listdir("/proc/self/task"):
                try:
                    os.sched_setscheduler(int(tid), policy, param)
                except OSError:
                    pass
            reply({"prio": n})
        if cmd[0] == "ar":  # ar <floats> <reps> <warmup>: back-to-back allreduces, each timed
            n, reps, warm = int(cmd[1]), int(cmd[2]), int(cmd[3])
            x = torch.ones(n)
            for _ in range(warm):
                dist.all_reduce(x)
            dist.barrier()
            times = []
            for _ in range(reps):
                x.fill_(1.0)
                t = time.perf_counter()
                dist.all_reduce(x)
                times.append(time.perf_counter() - t)
            assert float(x[0]) == dist.get_world_size()
            reply({"times": times})
        elif cmd[0] == "arc":  # arc <floats> <chunks> <reps> <warmup>: the same bytes as concurrent async allreduces
            n, chunks, reps, warm = int(cmd[1]), int(cmd[2]), int(cmd[3]), int(cmd[4])
            x = torch.ones(n)
            views = list(x.chunk(chunks))
            times = []
            for i in range(warm + reps):
                x.fill_(1.0)
                if i == warm:
                    dist.barrier()
                t = time.perf_counter()
                for work in [dist.all_reduce(v, async_op=True) for v in views]:
                    work.wait()
                if i >= warm:
                    times.append(time.perf_counter() - t)
            assert float(x[-1]) == dist.get_world_size()
            reply({"times": times})
        elif cmd[0] == "loop":  # loop <seconds>: 1-float allreduces until rank 0's clock says stop
            seconds = float(cmd[1])
            x = torch.zeros(2)
            dist.barrier()
            t_stop = time.monotonic() + seconds
            ops = []
            while True:
                x[0], x[1] = 1.0, 1.0 if (rank == 0 and time.monotonic() > t_stop) else 0.0
                t = time.monotonic()
                dist.all_reduce(x)
                ops.append((t, time.monotonic()))
                if x[1] > 0:  # the stop flag travels in the allreduce itself: both ranks stop together
                    break
            reply({"ops": ops})
    dist.destroy_process_group()


# --------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------
class Ranks:
    """Two ranks in a cluster (started by :func:`flexcomm.launch.start_ranks`), spoken to over pipes.

    A request is one line on every rank's stdin; each rank answers with one ``@@{json}`` line.
    """

    def __init__(self, cluster: Any) -> None:
        self.replies: list[queue.Queue[Any]] = [queue.Queue(), queue.Queue()]
        self.ranks: list[RankProcess] = start_ranks(
            [sys.executable, os.path.abspath(__file__), "--worker"], 2, cluster=cluster, port=PORT,
            output="capture", on_line=self._on_line, stdin=subprocess.PIPE)  # fmt: skip
        for rank in range(2):
            self._read(rank)

    def _on_line(self, rank: int, line: str) -> None:
        if line.startswith("@@"):
            self.replies[rank].put(json.loads(line[2:]))

    def _read(self, rank: int) -> Any:
        while True:
            try:
                return self.replies[rank].get(timeout=1.0)
            except queue.Empty:
                code = self.ranks[rank].proc.poll()
                if code is not None and self.replies[rank].empty():
                    raise RuntimeError(f"rank {rank} exited (rc={code}): {self.ranks[rank].stderr_tail()}") from None

    def ask(self, line: str) -> list[Any]:
        for r in self.ranks:
            assert r.proc.stdin is not None
            r.proc.stdin.write(line + "\n")
            r.proc.stdin.flush()
        return [self._read(rank) for rank in range(2)]

    def close(self) -> None:
        for r in self.ranks:
            try:
                assert r.proc.stdin is not None
                r.proc.stdin.write("quit\n")
                r.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                pass
        for r in self.ranks:
            r.proc.wait(30)
        stop_ranks(self.ranks)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median_ms(times: list[float]) -> float:
    return 1e3 * statistics.median(times)


def accuracy(cluster: Any, ranks: Ranks, delays_ms: list[float], budget_s: float) -> list[dict[str, Any]]:
    rows = []
    for d in [0.0, *delays_ms]:
        cluster.set_delay(d / 1e3)
        reps = int(max(30, min(400, budget_s / (4 * d / 1e3 + 0.001))))
        out = ranks.ask(f"ar 1 {reps} 5")
        t0, t1 = out[0]["times"], out[1]["times"]
        rows.append({"delay_ms": d, "reps": reps, "median_ms": median_ms(t0), "median_rank1_ms": median_ms(t1),
                     "p10_ms": 1e3 * sorted(t0)[len(t0) // 10], "p90_ms": 1e3 * sorted(t0)[9 * len(t0) // 10]})  # fmt: skip
        print(f"  delay {d:5.1f} ms: allreduce median {rows[-1]['median_ms']:7.3f} ms (rank 1 {rows[-1]['median_rank1_ms']:.3f}), {reps} reps", flush=True)
    base = rows[0]["median_ms"]
    pts = [(2 * r["delay_ms"], r["median_ms"] - base) for r in rows[1:]]
    k_fit = sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
    k = max(0.5, round(k_fit * 2) / 2)  # whole or half round trips
    for r in rows:
        r["base_ms"] = base
        r["k_fit"] = k_fit
        r["k"] = k
        r["expected_ms"] = base + k * 2 * r["delay_ms"]
        added = r["median_ms"] - base
        want = k * 2 * r["delay_ms"]
        r["added_ms"] = added
        r["error_ms"] = added - want
        r["error_pct"] = 100 * (added - want) / want if want else 0.0
        r["ok"] = abs(added - want) <= max(0.1 * want, 0.2)
    return rows


def tcp_bulk(cluster: Any, seconds: float) -> float:
    """Steady goodput (Mbit/s) of one TCP stream host 0 -> host 1 (receiver/sender of netem_check.py)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from netem_check import RECEIVER, SENDER

    dst = cluster.host_addr(1)
    rx = cluster.popen(1, [sys.executable, "-c", RECEIVER, dst, "29517", "1.0"], stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None
    if rx.stdout.readline().strip() != "ready":
        raise RuntimeError("TCP receiver did not start")
    tx = cluster.popen(0, [sys.executable, "-c", SENDER, dst, "29517", str(seconds)])
    tx.wait(seconds + 60)
    res = json.loads(rx.communicate(timeout=60)[0])
    return float(res["steady_bytes"] * 8 / res["steady_seconds"] / 1e6) if res["steady_seconds"] else float("nan")


def throughput(cluster: Any, ranks: Ranks, quick: bool, path: str, delays: tuple[float, ...], rates: tuple[str, ...]) -> list[dict[str, Any]]:
    rows = []
    pid = cluster.switch_pid
    for label in rates:
        rate = {"100mbit": 100e6, "1gbit": 1e9}[label]
        for d in delays:
            cluster.set_rate(rate)
            if cluster.delay_backend is not None:
                cluster.set_delay(d / 1e3)
            reps = (2 if quick else 3) if rate < 5e8 else (4 if quick else 8)
            c0, w0 = (cpu_seconds(pid) if pid else 0.0), time.monotonic()
            st0 = cluster.switch_stats() if pid else None
            out = ranks.ask(f"ar {MB40} {reps} 1")
            wall = time.monotonic() - w0
            cpu = (cpu_seconds(pid) - c0) if pid else float("nan")
            st1 = cluster.switch_stats() if pid else None
            t = statistics.median(out[0]["times"])
            mbit = MB40 * 4 * 8 / t / 1e6
            frames = sum(p["rx"] for p in st1["ports"]) - sum(p["rx"] for p in st0["ports"]) if st1 and st0 else 0
            gbytes = (sum(p["rx_bytes"] for p in st1["ports"]) - sum(p["rx_bytes"] for p in st0["ports"])) / 1e9 if st1 and st0 else 0.0
            drops = sum(p["drops"] + p["kernel_drops"] for p in st1["ports"]) if st1 else 0
            conc = ranks.ask(f"arc {MB40} 2 {reps} 1")
            t_conc = statistics.median(conc[0]["times"])
            tcp = tcp_bulk(cluster, 2.5 if quick else 4.0)
            rows.append({"path": path, "rate": label, "delay_ms": d, "reps": reps, "median_s": t, "mbit_s": mbit,
                         "pct_of_link": 100 * mbit / (rate / 1e6),
                         "async2_median_s": t_conc, "async2_mbit_s": MB40 * 32 / t_conc / 1e6,
                         "async2_pct_of_link": 100 * MB40 * 32 / t_conc / rate, "tcp_stream_mbit_s": tcp,
                         "tcp_pct_of_link": 100 * tcp / (rate / 1e6), "switch_cpu_s": cpu, "wall_s": wall,
                         "switch_cpu_pct": 100 * cpu / wall, "switch_frames": frames, "switch_gbytes": gbytes,
                         "switch_cpu_s_per_gb": cpu / gbytes if gbytes else float("nan"), "switch_drops_total": drops})  # fmt: skip
            r = rows[-1]
            print(f"  {path:6} {label:>7} delay {d:3.0f} ms: 40 MB allreduce {t * 1e3:7.1f} ms = {mbit:6.1f} Mbit/s "
                  f"({r['pct_of_link']:.0f}% of link); as 2 concurrent 20 MB allreduces {r['async2_mbit_s']:6.1f} Mbit/s "
                  f"({r['async2_pct_of_link']:.0f}%); one TCP stream {tcp:6.1f} Mbit/s ({r['tcp_pct_of_link']:.0f}%)", flush=True)  # fmt: skip
            if pid:
                print(f"         switch CPU {cpu:.2f} s over {wall:.1f} s ({r['switch_cpu_pct']:.0f}% of a core), "
                      f"{frames} frames for {gbytes:.2f} GB ({r['switch_cpu_s_per_gb']:.2f} CPU-s/GB), drops {drops}", flush=True)  # fmt: skip
    return rows


def change_latency(cluster: Any, ranks: Ranks, base_ms: float, k: float, quick: bool) -> tuple[list[dict[str, Any]], list[Any]]:
    lo, hi = 2.0, 20.0
    cluster.set_delay(lo / 1e3)
    n_changes = 4 if quick else 8
    gap = 1.0
    changes: list[tuple[float, float, float, float]] = []  # (t_before_call, t_after_call, old_ms, new_ms)

    def driver() -> None:
        time.sleep(gap)
        cur = lo
        for _ in range(n_changes):
            new = hi if cur == lo else lo
            t_a = time.monotonic()
            cluster.set_delay(new / 1e3)
            changes.append((t_a, time.monotonic(), cur, new))
            cur = new
            time.sleep(gap)

    th = threading.Thread(target=driver)
    th.start()
    out = ranks.ask(f"loop {gap * (n_changes + 1) + 0.5}")
    th.join()
    ops = out[0]["ops"]
    rows = []
    for t_a, t_b, old, new in changes:
        old_t = base_ms + k * 2 * old
        new_t = base_ms + k * 2 * new
        mid = (old_t + new_t) / 2 / 1e3
        first = next(((s, e) for s, e in ops if e > t_a and ((e - s) >= mid if new > old else (e - s) <= mid)), None)
        if first is None:
            rows.append({"old_ms": old, "new_ms": new, "call_ms": 1e3 * (t_b - t_a), "latency_ms": float("nan")})
            continue
        s, e = first
        rows.append({"old_ms": old, "new_ms": new, "call_ms": 1e3 * (t_b - t_a), "latency_ms": 1e3 * (e - t_a),
                     "op_start_after_change_ms": 1e3 * (s - t_a), "op_ms": 1e3 * (e - s)})  # fmt: skip
        print(f"  {old:4.0f} -> {new:4.0f} ms: set_delay took {rows[-1]['call_ms']:.2f} ms; first allreduce reflecting it "
              f"ended {rows[-1]['latency_ms']:.1f} ms after the call (it took {rows[-1]['op_ms']:.1f} ms)", flush=True)  # fmt: skip
    return rows, [ops, changes]


def plot(acc: list[dict[str, Any]], tput: list[dict[str, Any]], trace: list[Any], path: Path) -> None:
    fig, axes = common.figure(1, 3, figsize=(16, 4.5), squeeze=True)
    ax = axes[0]
    ds = [r["delay_ms"] for r in acc]
    ax.plot(ds, [r["median_ms"] for r in acc], "o", label="measured median")
    ax.plot(ds, [r["expected_ms"] for r in acc], "-", label=f"base + {acc[0]['k']:g} x 2d")
    ax.set_xlabel("one-way delay d (ms)")
    ax.set_ylabel("1-float allreduce (ms)")
    ax.set_title("delay accuracy (2 ranks, gloo)")
    ax.legend()
    ax = axes[1]
    labels = [f"{r['path']}\n{r['rate']}\n{r['delay_ms']:g} ms" for r in tput]
    xs = range(len(tput))
    w = 0.27
    series = (("pct_of_link", "one 40 MB allreduce"), ("async2_pct_of_link", "2 x 20 MB concurrent"),
              ("tcp_pct_of_link", "one TCP stream"))  # fmt: skip
    for j, (key, name) in enumerate(series):
        ax.bar([x + (j - 1) * w for x in xs], [r[key] for r in tput], w, label=name)
    for x, r in zip(xs, tput):
        ax.text(x - w, r["pct_of_link"] + 1, f"{r['mbit_s']:.0f}", ha="center", fontsize=7)
    ax.axhline(80, color="r", ls="--", lw=1)
    ax.set_xticks(list(xs), labels, fontsize=8)
    ax.set_ylabel("% of link rate (numbers: Mbit/s)")
    ax.set_ylim(0, 115)
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("throughput, 2 ranks")
    ax = axes[2]
    ops, changes = trace
    t0 = ops[0][0]
    ax.plot([e - t0 for _, e in ops], [1e3 * (e - s) for s, e in ops], ".", ms=3)
    for t_a, _, _, new in changes:
        ax.axvline(t_a - t0, color="r", lw=0.8)
    ax.set_xlabel("time (s); red = set_delay call")
    ax.set_ylabel("allreduce (ms)")
    ax.set_title("delay changes 2 <-> 20 ms mid-run")
    common.save(fig, path, dpi=110)


def main() -> int:
    parser = common.argument_parser(__doc__, "fewer repetitions")
    parser.add_argument("--worker", action="store_true", help="(run one rank; used by the driver)")
    parser.add_argument("--delays", default="1,5,16,32", help="one-way delays (ms) for the accuracy part")
    parser.add_argument("--no-throughput", action="store_true", help="skip part 2 (and the kernel-bridge throughput)")
    parser.add_argument("--rank-priority", type=int, default=5,
                        help="SCHED_FIFO priority of the ranks during the 1-float parts (0 = normal scheduling): "
                        "keeps other load on a shared machine out of the delay measurements")  # fmt: skip
    args = parser.parse_args()
    if args.worker:
        worker()
        return 0

    ok, reason = netem_available()
    if not ok:
        print(f"skipped: {reason}")
        return 0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    budget = 2.0 if args.quick else 4.0
    delays = [float(x) for x in args.delays.split(",")]
    t_start = time.monotonic()

    print("kernel bridge (no delay path):", flush=True)
    with EmulatedCluster(2, "1gbit", prefix="fcl") as bridge:
        ranks = Ranks(bridge)
        ranks.ask(f"prio {args.rank_priority}")
        out = ranks.ask("ar 1 400 5")
        ranks.ask("prio 0")
        bridge_ms = median_ms(out[0]["times"])
        print(f"  1-float allreduce median {bridge_ms:7.3f} ms", flush=True)
        tput = [] if args.no_throughput else throughput(
            bridge, ranks, args.quick, "bridge", (0.0,), ("1gbit",) if args.quick else ("100mbit", "1gbit")
        )
        ranks.close()

    with EmulatedCluster(2, "1gbit", prefix="fcl", delay=True) as cluster:
        print(f"delay backend: {cluster.delay_backend} (switch pid {cluster.switch_pid})", flush=True)
        sysctl = subprocess.run([*cluster.exec_prefix(0), "sysctl", "-n", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"],
                                capture_output=True, text=True).stdout.split("\n")  # fmt: skip
        print(f"host tcp_rmem = {sysctl[0]!r}, tcp_wmem = {sysctl[1]!r}", flush=True)
        ranks = Ranks(cluster)
        ranks.ask(f"prio {args.rank_priority}")
        print(f"1) delay accuracy, 1-float allreduce (ranks at SCHED_FIFO {args.rank_priority}):", flush=True)
        acc = accuracy(cluster, ranks, delays, budget)
        for r in acc:
            r["bridge_base_ms"] = bridge_ms
        print(f"  fitted round trips per allreduce k = {acc[0]['k_fit']:.3f} -> k = {acc[0]['k']:g}", flush=True)
        for r in acc[1:]:
            print(f"  d = {r['delay_ms']:4.1f} ms: measured {r['median_ms']:7.3f} ms, expected {r['expected_ms']:7.3f} ms "
                  f"(added {r['added_ms']:.3f} vs {r['k'] * 2 * r['delay_ms']:.3f} ms, {r['error_pct']:+.1f}%) "
                  f"{'OK' if r['ok'] else 'OFF'}", flush=True)  # fmt: skip
        print("3) change latency:", flush=True)
        chg, trace = change_latency(cluster, ranks, acc[0]["base_ms"], acc[0]["k"], args.quick)
        ranks.ask("prio 0")  # bulk transfers at normal priority: do not starve the machine
        if not args.no_throughput:
            print("2) throughput:", flush=True)
            tput += throughput(cluster, ranks, args.quick, "switch", (0.0, 5.0), ("100mbit", "1gbit"))
        stats = cluster.switch_stats()
        ranks.close()
    print(f"switch totals: {json.dumps({k: v for k, v in stats.items() if k != 'ports'})}", flush=True)
    common.write_csv(args.out_dir / "latency_accuracy.csv", acc)
    if tput:
        common.write_csv(args.out_dir / "latency_throughput.csv", tput)
    common.write_csv(args.out_dir / "latency_change.csv", chg)
    plot(acc, tput, trace, args.out_dir / "latency.png")
    print(f"wrote {args.out_dir}/latency_{{accuracy,throughput,change}}.csv and latency.png in {time.monotonic() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
