"""Tests for flexcomm.netem.

Schedule parsing, command building and the ScheduleRunner are pure and always
run. Everything that creates namespaces is skipped (with the reason) unless
``netem_available()`` says this machine allows it (root, ip, tc, netns).
Test clusters use their own prefixes (fct/fcs/fcg) so they never touch
namespaces of other runs.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flexcomm.netem.commands as commands
from flexcomm.netem import (
    SCHEDULE_FORMAT,
    EmulatedCluster,
    NetemUnavailable,
    Phase,
    RateChange,
    ScheduleRunner,
    cleanup_stale,
    format_rate,
    netem_available,
    parse_rate,
    parse_schedule,
    phase_at,
    tbf_args,
    tbf_burst_bytes,
)
from flexcomm.netem import delay as delay_switch
from flexcomm.netem.runner import PausableClock

# --------------------------------------------------------------------------
# Schedule parsing
# --------------------------------------------------------------------------


def test_parse_example_schedule() -> None:
    assert parse_schedule("1gbit:30s,50mbit:30s,300mbit") == [
        Phase(1e9, 30.0, 0.0),
        Phase(50e6, 30.0, 0.0),
        Phase(300e6, None, 0.0),
    ]


@pytest.mark.parametrize("text", ["none", "NONE", " None ", "", "   ", None])
def test_none_means_no_emulation(text: str | None) -> None:
    assert parse_schedule(text) == []


@pytest.mark.parametrize(
    ("text", "bits"),
    [
        ("1bit", 1.0),
        ("1kbit", 1e3),
        ("100mbit", 100e6),
        ("1gbit", 1e9),
        ("1.5Gbit", 1.5e9),
        ("2tbit", 2e12),
        ("1kibit", 1024.0),
        ("1mibit", 2.0**20),
        ("1bps", 8.0),  # tc: bps = bytes per second
        ("1kbps", 8e3),
        ("10mbps", 80e6),
        ("1MBps", 8e6),  # case-insensitive, as tc
        ("1gbps", 8e9),
        ("1kibps", 8 * 1024.0),
        ("1e3mbit", 1e9),
    ],
)
def test_rate_units_follow_tc(text: str, bits: float) -> None:
    assert parse_rate(text) == pytest.approx(bits)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("30s", 30.0), ("2m", 120.0), ("1h", 3600.0), ("0.25s", 0.25)],
)
def test_duration_units(text: str, seconds: float) -> None:
    assert parse_schedule(f"1gbit:{text},1mbit")[0].duration_s == pytest.approx(seconds)


def test_delay_per_phase() -> None:
    phases = parse_schedule("1gbit/5ms:30s, 50mbit/200us:1m ,300mbit/0.1s")
    assert [p.delay_s for p in phases] == pytest.approx([5e-3, 200e-6, 0.1])
    assert [p.duration_s for p in phases] == [30.0, 60.0, None]


def test_jitter_per_phase() -> None:
    phases = parse_schedule("1gbit/5ms~1ms:30s,100mbit/2ms:10s,10mbit/0ms~500us")
    assert [p.delay_s for p in phases] == pytest.approx([5e-3, 2e-3, 0.0])
    assert [p.jitter_s for p in phases] == pytest.approx([1e-3, 0.0, 500e-6])
    assert phases[0] == Phase(1e9, 30.0, 5e-3, 1e-3)
    assert Phase(1e9, 30.0, 5e-3) == Phase(1e9, 30.0, 5e-3, 0.0)  # jitter defaults to 0: old phases unchanged


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("1gbit/5ms~1ms~2ms", "more than one '~'"),
        ("1gbit/~1ms", "expected a number"),
        ("1gbit/5ms~", "expected a number"),
        ("1gbit/5ms~1xs", "unknown unit"),
        ("1gbit~1ms", "bad rate"),  # jitter needs a delay part
    ],
)
def test_bad_jitter_raises(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        parse_schedule(text)


def test_schedule_format_mentions_jitter() -> None:
    assert "DELAY~JITTER" in SCHEDULE_FORMAT and "RATE[/DELAY][:DURATION]" in SCHEDULE_FORMAT


def test_whitespace_tolerated() -> None:
    assert parse_schedule(" 1gbit : 30s , 2mbit ") == [Phase(1e9, 30.0), Phase(2e6, None)]


def test_last_phase_may_have_duration() -> None:
    assert parse_schedule("1gbit:1s,2gbit:2s")[-1].duration_s == 2.0


@pytest.mark.parametrize(
    ("text", "quoted", "why"),
    [
        ("1gbit:30s,fast", "'fast'", "expected a number"),
        ("100", "'100'", "a unit is required"),
        ("100mb", "'100mb'", "unknown unit 'mb'"),
        ("1gbit:30", "'30'", "a unit is required"),
        ("1gbit:30sec", "'30sec'", "unknown unit"),
        ("1gbit,2gbit", "'1gbit'", "no duration but is not the last"),
        ("0mbit", "'0mbit'", "must be > 0"),
        ("-1mbit", "'-1mbit'", "expected a number"),
        ("1gbit:0s,1mbit", "'0s'", "must be > 0"),
        ("1gbit:30s:5s", "'1gbit:30s:5s'", "more than one ':'"),
        ("1gbit/5ms/3ms", "'1gbit/5ms/3ms'", "more than one '/'"),
        ("1gbit/5xs:1s", "'5xs'", "unknown unit"),
        ("1gbit:30s,", "empty phase", "empty phase"),
        ("1gbit:30s,,2mbit", "empty phase", "empty phase"),
    ],
)
def test_bad_schedules_raise_with_context(text: str, quoted: str, why: str) -> None:
    with pytest.raises(ValueError) as info:
        parse_schedule(text)
    message = str(info.value)
    assert quoted in message
    assert why in message
    if "must be > 0" not in why:
        assert "RATE[/DELAY][:DURATION]" in message  # the expected format is spelled out


def test_schedule_format_mentions_units() -> None:
    for word in ("mbit", "kbps", "bytes", "ms", "none"):
        assert word in SCHEDULE_FORMAT


_phase = st.builds(
    Phase,
    rate_bps=st.integers(1, 10**11).map(float),
    duration_s=st.integers(1, 10**6).map(lambda ms: ms / 1000.0),
    delay_s=st.integers(0, 10**6).map(lambda us: us / 1e6),
    jitter_s=st.integers(0, 10**5).map(lambda us: us / 1e6),
)


@settings(max_examples=60, deadline=None)
@given(st.lists(_phase, min_size=1, max_size=6), st.booleans())
def test_schedule_round_trip(phases: list[Phase], open_end: bool) -> None:
    if open_end:
        phases = [*phases[:-1], Phase(phases[-1].rate_bps, None, phases[-1].delay_s, phases[-1].jitter_s)]
    text = ",".join(
        format_rate(p.rate_bps)
        + (f"/{round(p.delay_s * 1e6)}us" if p.delay_s or p.jitter_s else "")
        + (f"~{round(p.jitter_s * 1e6)}us" if p.jitter_s else "")
        + (f":{round(p.duration_s * 1000)}ms" if p.duration_s is not None else "")
        for p in phases
    )
    parsed = parse_schedule(text)
    assert len(parsed) == len(phases)
    for got, want in zip(parsed, phases):
        assert got.rate_bps == pytest.approx(want.rate_bps)
        assert got.delay_s == pytest.approx(want.delay_s)
        assert got.jitter_s == pytest.approx(want.jitter_s)
        assert (got.duration_s is None) == (want.duration_s is None)
        if want.duration_s is not None:
            assert got.duration_s == pytest.approx(want.duration_s)


def test_phase_at() -> None:
    phases = parse_schedule("1gbit:10s,2mbit:5s,3mbit:1s")
    assert phase_at([], 3.0) is None
    assert phase_at(phases, 0.0) == phases[0]
    assert phase_at(phases, 9.99) == phases[0]
    assert phase_at(phases, 10.0) == phases[1]
    assert phase_at(phases, 15.5) == phases[2]
    assert phase_at(phases, 1e6) == phases[2]  # last phase stays in force


# --------------------------------------------------------------------------
# tc argument building (pure)
# --------------------------------------------------------------------------


def test_format_rate_whole_bits() -> None:
    assert format_rate(50e6) == "50000000bit"
    assert format_rate(1e10) == "10000000000bit"
    with pytest.raises(ValueError):
        format_rate(0.2)


def test_tbf_burst_scales_with_rate() -> None:
    assert tbf_burst_bytes(10e6) == tbf_burst_bytes(100e6) == 80_000  # floor: a whole 64 KiB GSO packet fits at every rate
    assert tbf_burst_bytes(1e9) == 250_000  # ~256 kB measured accurate at 1 Gbit
    assert tbf_burst_bytes(10e9) == 2_500_000
    assert tbf_args(1e9) == ["tbf", "rate", "1000000000bit", "burst", "250000", "latency", "50ms"]


def test_netem_delay_args() -> None:
    assert commands.netem_delay_args(0.005) == ["netem", "delay", "5000us"]


def test_netem_args_with_jitter() -> None:
    assert commands.netem_delay_args(0.005) == ["netem", "delay", "5000us"]
    assert commands.netem_delay_args(0.005, 0.001) == ["netem", "delay", "5000us", "1000us"]


# --------------------------------------------------------------------------
# ScheduleRunner with a fake link
# --------------------------------------------------------------------------


class _FakeLink:
    def __init__(self, fail_on: float | None = None) -> None:
        self.calls: list[tuple[float, float | None]] = []
        self.fail_on = fail_on

    def set_rate(self, rate_bps: float, delay_s: float | None = None) -> None:
        if rate_bps == self.fail_on:
            raise RuntimeError("tc exploded")
        self.calls.append((rate_bps, delay_s))


def test_runner_walks_phases_in_order() -> None:
    link = _FakeLink()
    seen: list[RateChange] = []
    phases = parse_schedule("1mbit/1ms:50ms,2mbit:50ms,3mbit")
    runner = ScheduleRunner(link, phases, on_change=seen.append).start()
    assert runner.wait(5.0)
    runner.stop()
    assert link.calls == [(1e6, 1e-3), (2e6, 0.0), (3e6, 0.0)]
    assert [c.rate_bps for c in runner.changes] == [1e6, 2e6, 3e6]
    assert seen == runner.changes
    times = [c.time_s for c in runner.changes]
    assert times == sorted(times)
    assert times[2] >= 0.1 - 1e-3  # boundaries are absolute: 50 ms + 50 ms
    assert runner.start_wall is not None


def test_pausable_clock_stands_still_while_paused() -> None:
    now, paused = [0.0], [False]
    clock = PausableClock(lambda: now[0], lambda: paused[0])
    readings = []
    for t, pause in ((1.0, False), (1.5, True), (4.0, True), (4.5, False), (6.0, False), (7.0, True), (9.0, False)):
        now[0], paused[0] = t, pause
        readings.append(clock())
    # 1.5 -> 4.5 and 7.0 -> 9.0 paused: 3 s and 2 s do not count.
    assert readings == [1.0, 1.5, 1.5, 1.5, 3.0, 4.0, 4.0]


def test_runner_with_a_pause_applies_phases_on_unpaused_time() -> None:
    # A 50 ms first phase, paused from the start: nothing changes while paused, however long
    # (real time is only the thread's polling); unpaused, the change comes 50 ms of clock later.
    link, now, paused = _FakeLink(), [0.0], [True]
    runner = ScheduleRunner(link, parse_schedule("1mbit:50ms,2mbit"), clock=lambda: now[0], paused=lambda: paused[0])
    with runner:
        now[0] = 10.0
        time.sleep(0.05)  # ten polls of the paused clock
        assert link.calls == [(1e6, 0.0)]
        paused[0] = False
        time.sleep(0.02)  # the runner sees the pause end at clock 10.0
        now[0] = 10.06
        assert runner.wait(5.0)
    assert link.calls == [(1e6, 0.0), (2e6, 0.0)]
    assert [c.time_s for c in runner.changes] == [0.0, pytest.approx(0.06)]


def test_runner_stops_promptly() -> None:
    link = _FakeLink()
    runner = ScheduleRunner(link, parse_schedule("1mbit:60s,2mbit"))
    with runner:
        time.sleep(0.05)
    t0 = time.monotonic()
    assert not runner.running
    assert time.monotonic() - t0 < 1.0
    assert link.calls == [(1e6, 0.0)]


def test_runner_reports_set_rate_errors() -> None:
    runner = ScheduleRunner(_FakeLink(fail_on=2e6), parse_schedule("1mbit:10ms,2mbit"))
    runner.start()
    assert runner.wait(5.0)
    with pytest.raises(RuntimeError, match="tc exploded"):
        runner.stop()
    runner.stop()  # the error is reported once; stop stays idempotent


class _FakeJitterLink:
    def __init__(self) -> None:
        self.calls: list[tuple[float, float | None, float | None]] = []

    def set_rate(self, rate_bps: float, delay_s: float | None = None, jitter_s: float | None = None) -> None:
        self.calls.append((rate_bps, delay_s, jitter_s))


def test_runner_passes_jitter_only_when_the_schedule_has_some() -> None:
    link = _FakeJitterLink()
    runner = ScheduleRunner(link, parse_schedule("1mbit/5ms~1ms:20ms,2mbit/3ms")).start()
    assert runner.wait(5.0)
    runner.stop()
    assert link.calls == [(1e6, 5e-3, 1e-3), (2e6, 3e-3, 0.0)]  # back to 0 jitter explicitly
    assert [c.jitter_s for c in runner.changes] == [1e-3, 0.0]
    assert runner.changes[0]._asdict()["jitter_s"] == 1e-3
    # Without jitter in the schedule, two-argument setters (older fakes, other targets) still work.
    old = _FakeLink()
    runner = ScheduleRunner(old, parse_schedule("1mbit/5ms")).start()
    assert runner.wait(5.0)
    runner.stop()
    assert old.calls == [(1e6, 5e-3)]


# --------------------------------------------------------------------------
# Construction and availability (no root needed)
# --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"n_hosts": 0}, "n_hosts"),
        ({"n_hosts": 255}, "n_hosts"),
        ({"n_hosts": 2, "prefix": "f-c"}, "prefix"),
        ({"n_hosts": 2, "prefix": "fc1"}, "prefix"),
        ({"n_hosts": 200, "prefix": "abcdefgh"}, "15-character"),
        ({"n_hosts": 2, "schedule": "1gbit,2gbit"}, "no duration"),
    ],
)
def test_cluster_rejects_bad_arguments(kwargs: dict[str, object], match: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Interface names carry the pid: with a 3-digit pid "abcdefgh" + pid + "h199" is exactly 15
    # characters and passes, so the test runs as a process with a 5-digit pid would.
    monkeypatch.setattr(os, "getpid", lambda: 54321)
    with pytest.raises(ValueError, match=match):
        EmulatedCluster(**kwargs)  # type: ignore[arg-type]


def test_cluster_names_are_unique_and_short() -> None:
    a, b = EmulatedCluster(3, "1gbit"), EmulatedCluster(3, "1gbit")
    assert set(a.namespaces).isdisjoint(b.namespaces)
    assert str(os.getpid()) in a.tag
    for c in (a, b):
        for i in range(3):
            assert len(c.host_ifname(i)) <= 15 and len(c.bridge_port(i)) <= 15
            assert c.host_addr(i) == f"10.99.0.{i + 1}"
    with pytest.raises(IndexError):
        a.host_addr(3)


def test_unavailable_raises_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(commands, "netem_available", lambda: (False, "needs root (test)"))
    cluster = EmulatedCluster(2, "1gbit")
    with pytest.raises(NetemUnavailable, match="needs root \\(test\\)"):
        cluster.__enter__()
    assert issubclass(NetemUnavailable, RuntimeError)


def test_missing_reason_names_the_problem(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert "root" in (commands._missing_reason() or "")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(commands.shutil, "which", lambda name, path=None: None)
    assert "'ip'" in (commands._missing_reason() or "")
    with pytest.raises(NetemUnavailable, match="'tc'"):
        commands.tool_path("tc")


def test_command_error_includes_stderr() -> None:
    with pytest.raises(commands.NetemCommandError) as info:
        commands.run_cmd([sys.executable, "-c", "import sys; sys.stderr.write('boom-stderr'); sys.exit(3)"])
    assert "boom-stderr" in str(info.value) and "exit 3" in str(info.value)


def test_absolute_program() -> None:
    assert commands.absolute_program("env").startswith("/")
    assert commands.absolute_program("bin/x") == os.path.join(os.getcwd(), "bin/x")
    assert commands.absolute_program("/usr/bin/env") == "/usr/bin/env"


# --------------------------------------------------------------------------
# The user-space delay switch: pure parts (no root)
# --------------------------------------------------------------------------


def test_release_time_keeps_order_without_jitter() -> None:
    rng = random.Random(0)
    assert delay_switch.release_time(10.0, 0.005, 0.0, 0.0, rng) == pytest.approx(10.005)
    # The delay was lowered while an earlier frame still waits: the new frame queues behind it.
    assert delay_switch.release_time(10.001, 0.0, 0.0, 10.005, rng) == 10.005


def test_release_time_with_jitter_is_uniform_and_never_before_arrival() -> None:
    rng = random.Random(1)
    times = [delay_switch.release_time(1.0, 0.005, 0.002, 99.0, rng) - 1.0 for _ in range(2000)]
    assert min(times) >= 0.003 - 1e-12 and max(times) <= 0.007 + 1e-12  # last_release is ignored: may reorder
    assert abs(sum(times) / len(times) - 0.005) < 2e-4
    clipped = [delay_switch.release_time(1.0, 0.001, 0.005, 0.0, rng) for _ in range(500)]
    assert min(clipped) >= 1.0 and any(t == 1.0 for t in clipped)


def test_switch_control_commands() -> None:
    sw = delay_switch.Switch([])  # no ports: no sockets, no privileges needed
    assert sw.command("delay * 0.005 0.001") == "ok delay * 0.005 0.001"
    assert sw.command("delay * 0.002").startswith("ok")
    assert sw.command("delay 3 0.1").startswith("error no port 3")
    assert sw.command("delay * -1").startswith("error")
    assert sw.command("delay * nan").startswith("error")
    assert sw.command("delay * x").startswith("error")
    assert sw.command("frobnicate").startswith("error unknown command")
    stats = json.loads(sw.command("stats")[3:])
    assert stats["ports"] == [] and stats["queued"] == 0
    assert sw.command("quit") == "ok quit" and not sw.running


def test_switch_script_is_standalone() -> None:
    """The cluster runs delay.py with ``python -I``: no flexcomm (hence no torch) import, stdlib only."""
    out = subprocess.run([sys.executable, "-I", delay_switch.__file__, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--port" in out.stdout
    source = open(delay_switch.__file__).read()
    assert "import flexcomm" not in source and "from flexcomm" not in source and "from ." not in source


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [({"delay_backend": "tc"}, "delay_backend"), ({"switch_priority": 100}, "switch_priority"),
     ({"schedule": "1gbit/5000s"}, "delay_s")],  # fmt: skip
)
def test_cluster_rejects_bad_delay_arguments(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        EmulatedCluster(2, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------
# Real namespaces (root only)
# --------------------------------------------------------------------------

_AVAILABLE, _REASON = netem_available()
needs_netem = pytest.mark.skipif(not _AVAILABLE, reason=f"netem unavailable: {_REASON}")


def _netns() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def _assert_gone(cluster: EmulatedCluster) -> None:
    assert _netns().isdisjoint(cluster.namespaces)
    root_links = subprocess.run(["ip", "-o", "link"], check=True, capture_output=True, text=True).stdout
    assert f"{cluster.prefix}{os.getpid()}" not in root_links  # nothing ever leaks into the root ns


_ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], 29518)); srv.listen(1); srv.settimeout(10)
    print("ready", flush=True)
    conn, peer = srv.accept()
    conn.sendall(conn.recv(100) + b" from " + peer[0].encode())
    conn.close()
    """
)
_ECHO_CLIENT = textwrap.dedent(
    """
    import os, socket, sys
    s = socket.create_connection((sys.argv[1], 29518), timeout=10)
    s.sendall(b"ping"); print(s.recv(100).decode(), os.environ["GLOO_SOCKET_IFNAME"], flush=True)
    """
)


@needs_netem
def test_two_hosts_talk_over_shaped_link() -> None:
    with EmulatedCluster(2, "100mbit", prefix="fct") as cluster:
        server = cluster.popen(1, [sys.executable, "-c", _ECHO_SERVER, "10.99.0.2"], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        client = cluster.popen(0, [sys.executable, "-c", _ECHO_CLIENT, "10.99.0.2"], stdout=subprocess.PIPE, text=True)
        out, _ = client.communicate(timeout=15)
        assert server.wait(15) == 0 and client.returncode == 0
        assert out.split() == ["ping", "from", "10.99.0.1", cluster.host_ifname(0)]
        show = cluster.qdisc_show()
        assert show.count("tbf") == 4 and show.count("rate 100Mbit") == 4
    _assert_gone(cluster)


@needs_netem
def test_rate_change_and_schedule_show_in_tc() -> None:
    with EmulatedCluster(2, "100mbit:0.2s,20mbit", prefix="fct") as cluster:
        cluster.set_rate(50e6)
        for ns, dev in cluster.links():  # host egress and bridge ports: both directions
            out = subprocess.run(["tc", "-n", ns, "qdisc", "show", "dev", dev], check=True, capture_output=True, text=True).stdout
            assert "tbf" in out and "rate 50Mbit" in out, out
        runner = cluster.start_schedule()
        assert runner.wait(5.0)
        runner.stop()
        assert [c.rate_bps for c in runner.changes] == [100e6, 20e6]
        assert runner.changes[1].time_s >= 0.2 - 1e-3
        assert cluster.qdisc_show().count("rate 20Mbit") == 4
        assert cluster.rate_bps == 20e6
    _assert_gone(cluster)


@needs_netem
def test_unshaped_cluster_can_be_shaped_later_and_delay_is_tolerated() -> None:
    with EmulatedCluster(1, "none", prefix="fct") as cluster:
        assert "tbf" not in cluster.qdisc_show()
        cluster.set_rate(10e6)
        assert cluster.qdisc_show().count("rate 10Mbit") == 2
    with EmulatedCluster(1, "10mbit/5ms", prefix="fct") as cluster:  # warns if no netem, must not fail
        assert cluster.qdisc_show().count("rate 10Mbit") == 2


@needs_netem
def test_cleanup_after_exception() -> None:
    cluster = EmulatedCluster(2, "1gbit", prefix="fct")
    with pytest.raises(KeyError, match="inside"):
        with cluster:
            assert set(cluster.namespaces) <= _netns()
            proc = cluster.popen(0, [sys.executable, "-c", "import time; time.sleep(60)"])
            raise KeyError("inside")
    _assert_gone(cluster)
    assert proc.poll() is not None  # processes we launched are ended too
    cluster.close()  # idempotent


_SIGNAL_CHILD = textwrap.dedent(
    """
    import signal, sys, time
    from flexcomm.netem import EmulatedCluster
    # A test runner started as a shell's background job passes SIGINT on ignored, and the
    # cluster respects an ignored signal: the child handles it as an interactive program would.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with EmulatedCluster(2, "1gbit", prefix=sys.argv[1]) as c:
        print(" ".join(c.namespaces), flush=True)
        time.sleep(60)
    """
)


def _start_child(prefix: str) -> tuple[subprocess.Popen[str], list[str]]:
    child = subprocess.Popen([sys.executable, "-c", _SIGNAL_CHILD, prefix], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    names = child.stdout.readline().split()
    assert len(names) == 3 and set(names) <= _netns()
    return child, names


@needs_netem
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_cleanup_on_signal(sig: signal.Signals) -> None:
    child, names = _start_child("fcg")
    child.send_signal(sig)
    rc = child.wait(20)
    assert rc != 0
    if sig == signal.SIGTERM:
        assert rc == -signal.SIGTERM  # the signal is re-delivered after cleanup
    assert _netns().isdisjoint(names)


@needs_netem
def test_cleanup_stale_removes_only_dead_runs() -> None:
    child, names = _start_child("fcs")
    child.kill()  # SIGKILL: no chance to clean up
    child.wait(10)
    assert set(names) <= _netns()
    with EmulatedCluster(1, "1gbit", prefix="fcs") as live:  # a live run with the same prefix
        removed = cleanup_stale("fcs")
        assert set(removed) == set(names)
        assert removed[0].endswith("-br")  # bridges first: that removes the veth pairs
        assert set(live.namespaces) <= _netns()
    assert _netns().isdisjoint(names)
    _assert_gone(live)


@needs_netem
def test_set_rate_from_another_thread_while_running() -> None:
    with EmulatedCluster(2, "1gbit", prefix="fct") as cluster:
        errors: list[BaseException] = []

        def worker() -> None:
            try:
                for rate in (200e6, 300e6):
                    cluster.set_rate(rate)
            except BaseException as exc:  # noqa: BLE001
                errors.append(exc)

        t = threading.Thread(target=worker)
        t.start()
        t.join(10)
        assert not errors
        assert cluster.qdisc_show().count("rate 300Mbit") == 4


# --------------------------------------------------------------------------
# Real delay (root only): netem where the kernel has it, else the user-space switch
# --------------------------------------------------------------------------

_PING_SERVER = textwrap.dedent(
    """
    import socket, sys
    srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((sys.argv[1], 29519)); srv.listen(8)
    print("ready", flush=True)
    while True:
        conn, _ = srv.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        while True:
            data = conn.recv(64)
            if not data:
                break
            conn.sendall(data)
        conn.close()
    """
)
_PING_CLIENT = textwrap.dedent(
    """
    import json, socket, sys, time
    s = socket.create_connection((sys.argv[1], 29519), timeout=20)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(int(sys.argv[2])):
        t = time.monotonic(); s.sendall(b"x"); assert s.recv(64) == b"x"; rtts.append(time.monotonic() - t)
    print(json.dumps(rtts), flush=True)
    """
)


def _ping(cluster: EmulatedCluster, n: int) -> list[float]:
    """``n`` TCP round trips host 0 -> host 1 -> host 0 (a server must run on host 1)."""
    client = cluster.popen(0, [sys.executable, "-c", _PING_CLIENT, cluster.host_addr(1), str(n)], stdout=subprocess.PIPE, text=True)
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 0
    return list(json.loads(out))


def _start_ping_server(cluster: EmulatedCluster) -> None:
    server = cluster.popen(1, [sys.executable, "-c", _PING_SERVER, cluster.host_addr(1)], stdout=subprocess.PIPE, text=True)
    assert server.stdout is not None and server.stdout.readline().strip() == "ready"


def _pid_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@needs_netem
def test_delay_round_trip_change_and_cleanup() -> None:
    d = 0.005
    with EmulatedCluster(2, f"1gbit/{d * 1e3:g}ms", prefix="fct") as cluster:
        assert cluster.delay_emulated and cluster.delay_backend in ("netem", "switch")
        assert cluster.delay_s == d and cluster.host_delay(1) == (d, 0.0)
        switch_pid = cluster.switch_pid
        if cluster.delay_backend == "switch":
            assert switch_pid is not None and "rate 1Gbit" in cluster.qdisc_show()
        _start_ping_server(cluster)
        rtts = _ping(cluster, 20)
        # A round trip crosses two delayed links: never faster than 2 x delay (0.1 ms: clock conversion slack).
        assert sorted(rtts)[len(rtts) // 2] >= 2 * d
        assert min(rtts) >= 2 * d - 1e-4, rtts
        cluster.set_delay(0.02)  # applied mid-run, to the next packets
        assert min(_ping(cluster, 5)) >= 0.04 - 1e-4
        cluster.set_delay(0.0)
        cluster.set_delay(0.015, host=0)  # per link: only what host 0 sends is delayed
        assert cluster.host_delay(0) == (0.015, 0.0) and cluster.host_delay(1) == (0.0, 0.0)
        assert min(_ping(cluster, 5)) >= 0.015 - 1e-4
        cluster.set_rate(100e6, 0.01)  # the schedule's path: rate and delay together
        assert cluster.delay_s == 0.01 and cluster.host_delay(0) == (0.01, 0.0)
        assert min(_ping(cluster, 5)) >= 0.02 - 1e-4
        if switch_pid is not None:
            stats = cluster.switch_stats()
            assert stats["ports"][0]["rx"] > 0 and stats["ports"][1]["tx"] > 0
            assert stats["ports"][0]["delay_s"] == 0.01
    _assert_gone(cluster)
    if switch_pid is not None:
        assert _pid_gone(switch_pid)
    with pytest.raises(RuntimeError):
        cluster.set_delay(0.001)  # closed


_UDP_RECEIVER = textwrap.dedent(
    """
    import json, socket, struct, sys, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 22)
    s.bind((sys.argv[1], 29520)); s.settimeout(20)
    print("ready", flush=True)
    got = []
    while True:
        data = s.recv(64)
        seq, sent = struct.unpack("qd", data[:16])
        if seq < 0:
            break
        got.append((seq, time.monotonic() - sent))
    print(json.dumps(got), flush=True)
    """
)
_UDP_SENDER = textwrap.dedent(
    """
    import socket, struct, sys, time
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    s.connect((sys.argv[1], 29520))
    n, gap = int(sys.argv[2]), float(sys.argv[3])
    print("go", flush=True); sys.stdin.readline()
    for i in range(n):
        s.send(struct.pack("qd", i, time.monotonic()) + bytes(32))
        if i == n // 2 - 1:
            print("half", flush=True)
        time.sleep(gap)
    time.sleep(0.2)
    s.send(struct.pack("qd", -1, 0.0))
    """
)


def _udp_stream(cluster: EmulatedCluster, n: int, gap: float, midway: object = None) -> list[tuple[int, float]]:
    """Send ``n`` numbered datagrams host 0 -> host 1; return (seq, one-way s) of those received.

    ``midway()`` is called once the sender has sent the first half (packets 0 .. n/2 - 1)."""
    rx = cluster.popen(1, [sys.executable, "-c", _UDP_RECEIVER, cluster.host_addr(1)], stdout=subprocess.PIPE, text=True)
    assert rx.stdout is not None and rx.stdout.readline().strip() == "ready"
    tx = cluster.popen(0, [sys.executable, "-c", _UDP_SENDER, cluster.host_addr(1), str(n), str(gap)],
                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert tx.stdout is not None and tx.stdin is not None and tx.stdout.readline().strip() == "go"
    tx.stdin.write("\n")
    tx.stdin.flush()
    if callable(midway):
        assert tx.stdout.readline().strip() == "half"
        midway()
    assert tx.wait(60) == 0
    out, _ = rx.communicate(timeout=60)
    return [(int(seq), float(t)) for seq, t in json.loads(out)]


@needs_netem
def test_hosts_know_each_others_mac_from_the_start() -> None:
    """No ARP on the emulated links: a first packet never waits for (or is overtaken after) a reply."""
    with EmulatedCluster(3, "1gbit", prefix="fct") as cluster:
        out = subprocess.run([*cluster.exec_prefix(0), "ip", "neigh", "show"], check=True, capture_output=True,
                             text=True).stdout  # fmt: skip
        assert sorted(line.split()[0] for line in out.splitlines() if "PERMANENT" in line) == ["10.99.0.2", "10.99.0.3"]
    _assert_gone(cluster)


@needs_netem
def test_switch_keeps_order_when_the_delay_drops() -> None:
    """30 ms -> 0 ms mid-stream: later packets must queue behind earlier ones, not overtake them.

    The stream starts cold (no packet between the hosts before it): with ARP, its first
    packets waited a delayed round trip for the peer's MAC and the kernel's neighbour-queue
    flush let later packets overtake them ([0, 101, 1, 2, ...] on a loaded machine); the
    hosts' permanent neighbour entries leave nothing to wait for.
    """
    with EmulatedCluster(2, "1gbit", prefix="fct", delay=True, delay_backend="switch") as cluster:
        assert cluster.delay_backend == "switch"
        cluster.set_delay(0.03)
        got = _udp_stream(cluster, 600, 0.0005, midway=lambda: cluster.set_delay(0.0))
        seqs = [seq for seq, _ in got]
        assert len(seqs) >= 570  # UDP: allow a few losses on a loaded machine, but no reordering at all
        assert seqs == sorted(seqs)
        # The delay applies when a packet reaches the switch: the last packets sent before the
        # drop may still be in flight when it happens (and then only queue behind the rest).
        # The first 100 left at least 100 ms before the drop, so they met the full delay.
        assert min(t for seq, t in got if seq < 100) >= 0.03 - 1e-4
    _assert_gone(cluster)


@needs_netem
def test_switch_jitter_spreads_and_reorders() -> None:
    with EmulatedCluster(2, "1gbit/5ms~4ms", prefix="fct", delay_backend="switch") as cluster:
        assert cluster.host_delay(0) == (0.005, 0.004) and cluster.jitter_s == 0.004
        got = _udp_stream(cluster, 400, 0.0003)
        seqs = [seq for seq, _ in got]
        one_way = [t for _, t in got]
        assert len(seqs) >= 380
        assert seqs != sorted(seqs)  # with 4 ms of jitter and 0.3 ms spacing, reordering is all but certain
        assert min(one_way) >= 0.001 - 1e-4  # delay - jitter
        cluster.set_delay(0.005)  # jitter off again: order comes back
        seqs = [seq for seq, _ in _udp_stream(cluster, 200, 0.0003)]
        assert seqs == sorted(seqs)
    _assert_gone(cluster)


@needs_netem
def test_set_delay_needs_a_delay_path() -> None:
    with EmulatedCluster(1, "1gbit", prefix="fct") as cluster:
        assert cluster.delay_backend is None and cluster.switch_pid is None
        with pytest.raises(RuntimeError, match="delay=True"):
            cluster.set_delay(0.001)
        cluster.set_rate(1e9, 0.005)  # the schedule path only warns: "modelled, not emulated"
        assert cluster.delay_s == 0.0
    _assert_gone(cluster)


@needs_netem
def test_netem_backend_when_asked_for() -> None:
    cluster = EmulatedCluster(1, "1gbit/1ms", prefix="fct", delay_backend="netem")
    try:
        cluster.start()
    except NetemUnavailable as exc:  # this kernel has no netem: clear error, nothing left behind
        assert "netem" in str(exc)
    else:
        assert cluster.delay_backend == "netem" and "netem" in cluster.qdisc_show()
    finally:
        cluster.close()
    _assert_gone(cluster)


_DELAY_CHILD = textwrap.dedent(
    """
    import sys, time
    from flexcomm.netem import EmulatedCluster
    with EmulatedCluster(2, "1gbit/1ms", prefix=sys.argv[1], delay_backend="switch") as c:
        print(" ".join(c.namespaces), c.switch_pid, flush=True)
        time.sleep(60)
    """
)


@needs_netem
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_switch_dies_with_its_cluster(sig: signal.Signals) -> None:
    child = subprocess.Popen([sys.executable, "-c", _DELAY_CHILD, "fcd"], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    *names, pid = child.stdout.readline().split()
    assert len(names) == 3 and set(names) <= _netns() and not _pid_gone(int(pid), 0.1)
    child.send_signal(sig)
    child.wait(20)
    assert _pid_gone(int(pid))  # SIGTERM: the cluster stops it; SIGKILL: it sees EOF on its pipe and exits
    if sig == signal.SIGKILL:
        assert set(names) <= set(cleanup_stale("fcd"))
    assert _netns().isdisjoint(names)
