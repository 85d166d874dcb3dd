"""Shared by ``e2e.py`` and ``dynamic_cr.py``: build, run and collect ``flexcomm-train`` runs.

A :class:`Spec` is one training run.  Its run directory under ``benchmarks/results/runs/``
is named from its settings (a readable prefix plus a hash of the full command line), so
two scripts asking for the same configuration share one directory: the second one finds
``summary.json`` there and reuses the run instead of training again.  A directory without
``summary.json`` (a run that crashed or was interrupted) is wiped and run again, so a
re-run of a script resumes where it stopped.

Runs are sequential (one job at a time on the 2 cores), every run prints one progress
line before and one after, and its output goes to ``train.log`` in the run directory
(deleted once the run succeeded; kept for a failed one).  ``bench.json`` keeps the exact
command, the launcher's wall time (start-up and teardown included), the cores other
processes kept busy meanwhile, and a hash of flexcomm's sources (the tree is shared and
may change between runs).  Only small files are kept: ``config.json``, ``data.json``,
``records.jsonl``, ``summary.json``, ``network.json``, ``bench.json``.

Analysis helpers: the first evaluation at or above a target accuracy (training time =
sum of step times, as ``summary.json``'s ``time_to_target``; and wall time), mean step
time per network phase (phases from ``network.json``'s applied rate changes, each step
placed by the midpoint of its training time on the run's wall clock), and Markdown
tables.  A run's files are read with :mod:`flexcomm.train.records`' readers.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexcomm.train.records import NETWORK_FILE, RECORDS_FILE, SUMMARY_FILE, read_records, read_summary

BENCH = Path(__file__).resolve().parent
RESULTS = BENCH / "results"
RUNS = RESULTS / "runs"
TRAIN = str(Path(sys.executable).parent / "flexcomm-train")
KEEP = {"config.json", "data.json", RECORDS_FILE, SUMMARY_FILE, NETWORK_FILE, "bench.json"}

# -- settings shared by both scripts (identical settings => identical run directory) -------------
TRAIN_SUBSET = 10_000
TEST_SUBSET = 1000
EVAL_EVERY = 50
SEED = 0
#: ResNet-18 / ViT: ~25-60 s of training per run at 400 steps on 2 ranks; every run sees
#: the slow phase (a compressed run takes > 28 s), dense spends ~50 steps in it.
NET = "1gbit:8s,30mbit:20s,200mbit"
#: AlexNet steps ~3x faster when compressed (small convs, big FC): shorter phases.
NET_FAST = "1gbit:3s,30mbit:8s,200mbit"
MODELS: dict[str, dict[str, Any]] = {
    "resnet18": {"width": 0.125, "steps": 400, "net": NET},
    "vit": {"width": 0.5, "steps": 400, "net": NET},
    "alexnet": {"width": 0.125, "steps": 500, "net": NET_FAST},
    # The demo's MLP: 2.7 MB of gradients and little compute per step, so the network decides.
    "mlp": {"width": 0.5, "steps": 300, "net": NET},
}
#: 4 ranks on 2 cores are oversubscribed (~2x slower steps) and see 2x the samples per step.
STEPS_4 = 300
AUTO_EVERY = 25


def auto_warmup(steps: int) -> int:
    """--auto-warmup: 10% of the run."""
    return max(1, steps // 10)


@dataclass(frozen=True)
class Spec:
    """One flexcomm-train run."""

    model: str
    compressor: str
    density: str | None = None  # "0.01", "auto"; None for dense / fp16 / powersgd
    powersgd_rank: int | None = None
    nproc: int = 2
    partition: str = "iid"
    dirichlet_alpha: float | None = None
    steps: int | None = None  # default: MODELS[model]["steps"] (STEPS_4 on 4 ranks)
    net: str | None = None  # default: MODELS[model]["net"]
    seed: int = SEED
    auto_every: int = AUTO_EVERY  # --auto-every of density="auto" (also its ramp's steps per candidate)
    auto_warmup: int | None = None  # --auto-warmup; default auto_warmup(steps)
    eval_every: int = EVAL_EVERY
    auto_rule: str | None = None  # --auto-rule; None: flexcomm-train's default (of the day the run ran)
    test_subset: int = TEST_SUBSET  # 10000: the full Fashion-MNIST test set
    app_defaults: bool = False  # density="auto" as a user runs it: no --auto-* flag but auto_rule's
    bucket_cap_mb: float | None = None  # --bucket-cap-mb; None: DDP's default buckets
    tags: tuple[str, ...] = field(default=(), compare=False)

    # -- resolved settings -----------------------------------------------------------------------
    @property
    def n_steps(self) -> int:
        if self.steps is not None:
            return self.steps
        return STEPS_4 if self.nproc >= 4 else MODELS[self.model]["steps"]

    @property
    def schedule(self) -> str:
        return self.net or MODELS[self.model]["net"]

    @property
    def method(self) -> str:
        """Short label: dense, fp16, powersgd-r1, artopk-star 0.01, artopk-star auto, ..."""
        if self.compressor == "powersgd":
            return f"powersgd-r{self.powersgd_rank or 1}"
        if self.density is None or self.compressor == "dense":
            return self.compressor
        rule = f" {self.auto_rule}" if self.auto_rule not in (None, "goodput") else ""
        return f"{self.compressor} {self.density}{rule}"

    @property
    def group(self) -> str:
        part = "" if self.partition == "iid" else f" {self.partition}({self.dirichlet_alpha:g})"
        return f"{self.model} x{MODELS[self.model]['width']:g}, {self.nproc} ranks{part}"

    def args(self) -> list[str]:
        """flexcomm-train's arguments, without --out."""
        a = [
            "--model", self.model, "--width", f"{MODELS[self.model]['width']:g}",
            "--nproc", str(self.nproc), "--net", self.schedule,
            "--steps", str(self.n_steps), "--train-subset", str(TRAIN_SUBSET),
            "--test-subset", str(self.test_subset), "--eval-every", str(self.eval_every),
            "--seed", str(self.seed), "--checkpoint-every", "0", "--no-report",
            "--compressor", self.compressor,
        ]
        if self.partition != "iid":
            a += ["--partition", self.partition, "--dirichlet-alpha", f"{self.dirichlet_alpha:g}"]
        if self.density is not None and self.compressor not in ("powersgd", "fp16"):
            a += ["--density", self.density]
        if self.density == "auto" and not self.app_defaults:
            warmup = auto_warmup(self.n_steps) if self.auto_warmup is None else self.auto_warmup
            a += ["--auto-warmup", str(warmup), "--auto-every", str(self.auto_every)]
            if self.auto_rule is not None:
                a += ["--auto-rule", self.auto_rule]
        elif self.density == "auto" and self.auto_rule is not None:  # the app's defaults but one
            a += ["--auto-rule", self.auto_rule]
        if self.compressor == "powersgd":
            a += ["--powersgd-rank", str(self.powersgd_rank or 1)]
        if self.bucket_cap_mb is not None:
            a += ["--bucket-cap-mb", f"{self.bucket_cap_mb:g}"]
        return a

    @property
    def name(self) -> str:
        digest = hashlib.sha1(" ".join(self.args()).encode()).hexdigest()[:6]
        part = "iid" if self.partition == "iid" else f"dir{self.dirichlet_alpha:g}"
        method = self.method.replace(" ", "-d") if self.density not in (None, "auto") else self.method.replace(" ", "-")
        seed = "" if self.seed == SEED else f"-s{self.seed}"
        return f"{self.model}-n{self.nproc}-{part}-{method}{seed}-{digest}"

    @property
    def dir(self) -> Path:
        return RUNS / self.name

    def command(self) -> list[str]:
        return [TRAIN, *self.args(), "--out", str(self.dir)]

    def pretty_command(self) -> str:
        """The command as run from the repository root."""
        rel = self.dir.relative_to(BENCH.parent)
        return shlex.join([".venv/bin/flexcomm-train", *self.args(), "--out", str(rel)])


# -- running ------------------------------------------------------------------------------------------
def done(spec: Spec) -> bool:
    return (spec.dir / SUMMARY_FILE).exists()


class Runner:
    """Runs specs one at a time, skipping finished ones; keeps a wall-clock account."""

    def __init__(self, label: str) -> None:
        self.label = label
        self.started = time.monotonic()
        self.ran: list[tuple[Spec, float]] = []
        self.reused: list[Spec] = []
        self.failed: list[Spec] = []

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def mean_run_seconds(self, default: float = 60.0) -> float:
        return statistics.fmean(s for _, s in self.ran) if self.ran else default

    def run_all(self, specs: Sequence[Spec]) -> None:
        todo = [s for s in specs if not done(s)]
        for spec in specs:
            if done(spec) and spec not in self.reused:
                self.reused.append(spec)
        for i, spec in enumerate(todo, 1):
            self.run_one(spec, f"{i}/{len(todo)}")

    def run_one(self, spec: Spec, position: str = "") -> bool:
        if done(spec):
            return True
        if spec.dir.exists():
            shutil.rmtree(spec.dir)  # an unfinished run: start it over
        spec.dir.mkdir(parents=True)
        print(f"[{self.label} {position} {_clock(self.elapsed())}] {spec.group}: {spec.method} "
              f"({spec.n_steps} steps, net {spec.schedule}) -> {spec.dir.name}", flush=True)
        log = spec.dir / "train.log"
        library = library_hash()
        t0, busy0, ours0 = time.monotonic(), _busy_cpu_seconds(), _children_cpu_seconds()
        with open(log, "w") as out:
            code = subprocess.call(spec.command(), stdout=out, stderr=subprocess.STDOUT, cwd=BENCH.parent)
        seconds = time.monotonic() - t0
        # Cores used by other processes on the machine during the run (shared 2-core machine).
        foreign = ((_busy_cpu_seconds() - busy0) - (_children_cpu_seconds() - ours0)) / seconds
        if code != 0 or not done(spec):
            tail = log.read_text(errors="replace").replace("\r", "\n").splitlines()[-8:]
            print(f"    FAILED (exit {code}) after {seconds:.0f} s; log kept in {log}:\n      " + "\n      ".join(tail),
                  flush=True)
            self.failed.append(spec)
            return False
        (spec.dir / "bench.json").write_text(json.dumps(
            {"command": spec.pretty_command(), "launcher_wall_s": seconds, "foreign_cores": foreign,
             "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "library_sha1": library},
            indent=2) + "\n")
        for path in spec.dir.iterdir():
            if path.name not in KEEP:
                shutil.rmtree(path) if path.is_dir() else path.unlink()
        s = read_summary(spec.dir)
        self.ran.append((spec, seconds))
        print(f"    done in {seconds:.0f} s (training {s['train_time']:.1f} s, mean step "
              f"{s['mean_step_time'] * 1e3:.0f} ms, best acc {s['best_accuracy']:.3f}, final "
              f"{s['final_accuracy']:.3f}; other processes used {foreign:.2f} cores)", flush=True)
        return True

    def account(self) -> str:
        ran = sum(s for _, s in self.ran)
        return (f"{self.label}: {len(self.ran)} runs trained ({_clock(ran)} of launcher time), "
                f"{len(self.reused)} reused, {len(self.failed)} failed; script wall-clock {_clock(self.elapsed())}")


def library_hash() -> str:
    """SHA-1 of flexcomm's sources (src/flexcomm/**/*.py) when a run starts: the tree is shared and may change."""
    h = hashlib.sha1()
    for path in sorted((BENCH.parent / "src" / "flexcomm").rglob("*.py")):
        h.update(str(path.relative_to(BENCH.parent)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()[:10]


def _busy_cpu_seconds() -> float:
    """CPU seconds spent busy by the whole machine since boot (/proc/stat; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _children_cpu_seconds() -> float:
    """CPU seconds of this process's finished descendants (flexcomm-train and its ranks)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def _clock(seconds: float) -> str:
    m, s = divmod(int(round(seconds)), 60)
    return f"{m}m{s:02d}s"


# -- loading and analysis -----------------------------------------------------------------------------
def load_json(path: Path) -> Any:
    return json.loads(path.read_text()) if path.exists() else None


@dataclass
class Run:
    spec: Spec
    summary: dict[str, Any]
    records: list[dict[str, Any]]
    network: dict[str, Any] | None
    data: dict[str, Any] | None
    bench: dict[str, Any] | None

    @property
    def evals(self) -> list[dict[str, Any]]:
        return [r for r in self.records if r.get("accuracy") is not None]


def load(spec: Spec) -> Run | None:
    if not done(spec):
        return None
    return Run(spec, read_summary(spec.dir), read_records(spec.dir), load_json(spec.dir / NETWORK_FILE),
               load_json(spec.dir / "data.json"), load_json(spec.dir / "bench.json"))


def time_to_target(run: Run, target: float, window: int = 1) -> tuple[float | None, float | None, int | None]:
    """(training seconds, wall seconds, step) at the first evaluation where the mean of the last ``window``
    evaluations is >= target; Nones if never.  ``window`` 1: the first evaluation >= target."""
    elapsed, recent = 0.0, deque(maxlen=window)
    for r in run.records:
        elapsed += r["t_step"]
        if r.get("accuracy") is None:
            continue
        recent.append(r["accuracy"])
        if len(recent) == window and statistics.fmean(recent) >= target:
            return elapsed, r["wall"], r["step"] + 1
    return None, None, None


def rate_label(bps: float) -> str:
    if bps >= 1e9 and bps % 1e9 == 0:
        return f"{bps / 1e9:g}gbit"
    return f"{bps / 1e6:g}mbit"


def phases(run: Run) -> list[tuple[float, float, float]]:
    """(start s, end s, rate bit/s) of each applied rate, on the run's wall clock."""
    if not run.network or not run.network.get("changes"):
        return []
    changes = run.network["changes"]
    out = []
    for i, c in enumerate(changes):
        start = 0.0 if i == 0 else c["time_s"]
        end = changes[i + 1]["time_s"] if i + 1 < len(changes) else math.inf
        out.append((start, end, c["rate_bps"]))
    return out


def schedule_time(record: dict[str, Any]) -> float:
    """When ``record``'s step ended on the clock of the link schedule (see :func:`step_midpoints`)."""
    return record.get("train_wall", record["wall"])


def step_midpoints(run: Run) -> list[float]:
    """The middle of each step's training on the clock of the run's link schedule.

    Runs that record ``train_wall`` had a schedule that stood still while they evaluated (the
    phases of ``network.json`` are on training time); older ones, on wall time, are read on ``wall``.
    """
    mids, previous = [], 0.0
    for r in run.records:
        mids.append(previous + r["t_step"] / 2)
        previous = schedule_time(r)
    return mids


def phase_step_times(run: Run) -> list[dict[str, Any]]:
    """Per applied phase: label, rate, start/end, steps in it, mean step time (s)."""
    mids = step_midpoints(run)
    out = []
    for i, (start, end, rate) in enumerate(phases(run)):
        times = [r["t_step"] for r, m in zip(run.records, mids) if start <= m < end]
        out.append({"phase": i + 1, "label": f"P{i + 1} {rate_label(rate)}", "rate_bps": rate, "start": start,
                    "end": end, "steps": len(times), "mean_step_time": statistics.fmean(times) if times else None})
    return out


def slowest_phase(run: Run) -> dict[str, Any] | None:
    ps = phase_step_times(run)
    return min(ps, key=lambda p: p["rate_bps"]) if ps else None


def target_from(dense: Run | None, fraction: float) -> float | None:
    """``fraction`` of the dense run's best accuracy, rounded down to 0.1 pp."""
    if dense is None or dense.summary.get("best_accuracy") is None:
        return None
    return math.floor(dense.summary["best_accuracy"] * fraction * 1000) / 1000


def metrics(run: Run, target: float | None, alt_target: float | None = None) -> dict[str, Any]:
    """One table row (``alt_target``: a second, looser target, reported alongside)."""
    s, spec = run.summary, run.spec
    ttt, ttt_wall, ttt_step = time_to_target(run, target) if target is not None else (None, None, None)
    row: dict[str, Any] = {
        "group": spec.group,
        "model": spec.model,
        "nproc": spec.nproc,
        "partition": spec.partition if spec.partition == "iid" else f"dirichlet({spec.dirichlet_alpha:g})",
        "method": spec.method,
        "compressor": spec.compressor,
        "density": spec.density or "",
        "steps": s["steps"],
        "net": spec.schedule,
        "target_acc": target,
        "time_to_target_s": ttt,
        "wall_to_target_s": ttt_wall,
        "step_to_target": ttt_step,
        "alt_target_acc": alt_target,
        "time_to_alt_target_s": time_to_target(run, alt_target)[0] if alt_target is not None else None,
        "final_acc": s["final_accuracy"],
        "best_acc": s["best_accuracy"],
        "total_bytes": s["total_bytes"],
        "mean_density": s.get("mean_density"),
        "train_time_s": s["train_time"],
        "wall_time_s": s["wall_time"],
        "mean_step_ms": s["mean_step_time"] * 1e3,
        "mean_t_compute_ms": _ms(s.get("mean_t_compute")),
        "mean_t_sync_ms": _ms(s.get("mean_t_sync")),
        "mean_t_wait_ms": _ms(s.get("mean_t_wait")),
        "mean_t_compress_ms": _ms(s.get("mean_t_compress")),
    }
    for p in phase_step_times(run):
        row[f"step_ms_P{p['phase']}"] = _ms(p["mean_step_time"])
        row[f"steps_P{p['phase']}"] = p["steps"]
    slow = slowest_phase(run)
    row["slow_phase"] = slow["label"] if slow else None
    row["step_ms_slow"] = _ms(slow["mean_step_time"]) if slow else None
    lc = s.get("leader_counts")
    row["leader_counts"] = " ".join(str(c) for c in lc) if lc and sum(lc) else ""
    row["launcher_wall_s"] = (run.bench or {}).get("launcher_wall_s")
    row["foreign_cores"] = (run.bench or {}).get("foreign_cores")
    row["finished_utc"] = (run.bench or {}).get("finished_utc") or _mtime_utc(spec.dir / SUMMARY_FILE)
    row["library_sha1"] = (run.bench or {}).get("library_sha1")
    row["run_dir"] = str(spec.dir.relative_to(BENCH.parent))
    return row


def _mtime_utc(path: Path) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(path.stat().st_mtime))


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1e3


def fmt(v: Any, spec: str = ".3g", missing: str = "-") -> str:
    if v is None or v == "":
        return missing
    if isinstance(v, float) and not math.isfinite(v):
        return missing
    return format(v, spec) if isinstance(v, (int, float)) else str(v)


def mbytes(n: int | None) -> str:
    return "-" if n is None else f"{n / 1e6:.2f}"


def md_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def shade_phases(ax: Any, run: Run | None, label: bool = True) -> None:
    """Shade each network phase of ``run`` (darker = slower) on a wall-time x axis; set the x limits after."""
    if run is None:
        return
    ps = phases(run)
    if not ps:
        return
    rates = [r for _, _, r in ps]
    lo, hi = math.log10(min(rates)), math.log10(max(rates))
    for start, end, rate in ps:
        depth = 0.0 if hi == lo else (hi - math.log10(rate)) / (hi - lo)
        end = min(end, 1e5)  # the last phase lasts forever: the caller sets the x limits
        ax.axvspan(start, end, color="tab:red", alpha=0.04 + 0.16 * depth, lw=0)
        if label:
            ax.annotate(rate_label(rate), (start, 0.98), xycoords=("data", "axes fraction"), va="top",
                        ha="left", fontsize="x-small", color="tab:red")


def fit_x(ax: Any, rs: Iterable[Run]) -> None:
    """x limits: 0 to the longest run's time on the link schedule's clock."""
    right = max((schedule_time(r.records[-1]) for r in rs if r.records), default=1.0)
    ax.set_xlim(0, right * 1.03)
