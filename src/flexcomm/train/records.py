"""The run directory's logs: ``records.jsonl`` (one JSON object per step) and its summary.

Written by rank 0 only.  The summary is computed from the records file, not from
counters kept in memory, so a run resumed from a checkpoint summarises its whole
history, and ``flexcomm-report`` can summarise a run that crashed before writing
``summary.json``.

Fields of a step record (times in seconds, measured on rank 0):

``step`` (0-based), ``epoch``, ``wall`` (since training started, evaluation
included), ``train_wall`` (the same without evaluation: the clock of an emulated link's
schedule, which stands still while the ranks evaluate), ``loss`` (rank 0's mini-batch loss), ``t_step`` (the whole step),
``t_compute`` (forward + backward, which includes the hook, since DDP overlaps them),
``t_wait`` (the part of backward held up by communication), ``t_compress``,
``t_sync`` (summed exchange times; they overlap backward), ``t_optim``,
``bytes`` (payload this rank handed to collectives), ``density``, ``exchanges``,
``leaders`` (AR-Topk index-source ranks), ``gain`` (mean compression gain over
buckets), ``finite`` (false: some rank's gradient was not finite, so the hook made the
update NaN everywhere and the optimizer step was skipped), ``explored`` (some bucket ran
``flex``'s exploration of an alternative exchange), ``quality`` (mean ``cos(update, mean
gradient)`` over the buckets that measured it, else null); at evaluation points also
``accuracy`` and ``test_loss``.
"""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import IO, Any

RECORDS_FILE = "records.jsonl"
SUMMARY_FILE = "summary.json"
#: Written by the launcher of an emulated run: the schedule and the rate changes really applied.
NETWORK_FILE = "network.json"


def clean(value: Any) -> Any:
    """JSON has no NaN/Infinity: non-finite floats become ``null``."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [clean(v) for v in value]
    return value


class RecordWriter:
    """Appends step records, flushed per line so a crashed run still leaves its log."""

    def __init__(self, run_dir: Path, resume_step: int) -> None:
        self.path = run_dir / RECORDS_FILE
        if resume_step > 0:
            _drop_records_from(self.path, resume_step)
        elif self.path.exists():
            self.path.unlink()
        self._file: IO[str] = open(self.path, "a")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(json.dumps(clean(record)) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def _drop_records_from(path: Path, step: int) -> None:
    """Forget steps at or after ``step``: a resumed run redoes them from its checkpoint."""
    kept = [r for r in _parse(path) if r["step"] < step]
    path.write_text("".join(json.dumps(r) + "\n" for r in kept))


def _parse(path: Path) -> list[dict[str, Any]]:
    """The records in ``path``; a torn line (a crash mid-write) is skipped."""
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


def read_records(run_dir: Path) -> list[dict[str, Any]]:
    """All step records of a run, in step order."""
    return sorted(_parse(Path(run_dir) / RECORDS_FILE), key=lambda r: r["step"])


#: ``final_accuracy_mean`` averages this many of the last evaluations: one evaluation swings.
FINAL_EVALS = 3


def final_accuracy(records: list[dict[str, Any]], every: int = 1) -> float | None:
    """The mean of the last :data:`FINAL_EVALS` evaluations ``every`` steps apart, counted back from the last one.

    A run evaluated often (to place its time to target) keeps a final accuracy that spans the end
    of the run, not its last few steps: evaluated every 5 steps, ``every=25`` averages the
    evaluations after steps 250, 275 and 300 of a 300-step run (260, 285 and 310 of a 310-step
    one).  Where fewer lie on that grid, the last evaluations whatever their spacing.
    """
    evals = [r for r in records if r.get("accuracy") is not None]
    if not evals:
        return None
    last = evals[-1]["step"]
    spaced = [r["accuracy"] for r in evals if (last - r["step"]) % every == 0]
    chosen = spaced if len(spaced) >= FINAL_EVALS else [r["accuracy"] for r in evals]
    return statistics.fmean(chosen[-FINAL_EVALS:])


def summarize(records: list[dict[str, Any]], target_acc: float | None) -> dict[str, Any]:
    """Run-level numbers from the step records.

    ``time_to_target`` is training time (the sum of step times, so evaluation and
    start-up are excluded) up to the first evaluation at or above ``target_acc``.
    ``final_accuracy`` is the last evaluation's, ``final_accuracy_mean`` the mean of the
    last :data:`FINAL_EVALS`.
    """
    evals = [r for r in records if r.get("accuracy") is not None]
    step_times = [r["t_step"] for r in records]
    elapsed = 0.0
    time_to_target = step_to_target = None
    for r in records:
        elapsed += r["t_step"]
        if target_acc is not None and step_to_target is None and (r.get("accuracy") or -1.0) >= target_acc:
            time_to_target, step_to_target = elapsed, r["step"]
    return {
        "steps": len(records),
        "train_time": elapsed,
        "wall_time": records[-1]["wall"] if records else 0.0,
        "mean_step_time": statistics.fmean(step_times) if step_times else None,
        "median_step_time": statistics.median(step_times) if step_times else None,
        **{f"mean_{key}": _mean(records, key) for key in ("t_compute", "t_wait", "t_compress", "t_sync", "t_optim")},
        "total_bytes": sum(r["bytes"] for r in records),
        "mean_density": _mean(records, "density"),
        "final_accuracy": evals[-1]["accuracy"] if evals else None,
        "final_accuracy_mean": final_accuracy(records),
        "final_test_loss": evals[-1]["test_loss"] if evals else None,
        "best_accuracy": max(r["accuracy"] for r in evals) if evals else None,
        "target_acc": target_acc,
        "time_to_target": time_to_target,
        "step_to_target": step_to_target,
    }


def _mean(records: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in records if r.get(key) is not None]
    return statistics.fmean(values) if values else None


def write_summary(run_dir: Path, summary: dict[str, Any]) -> Path:
    path = Path(run_dir) / SUMMARY_FILE
    path.write_text(json.dumps(clean(summary), indent=2) + "\n")
    return path


def read_summary(run_dir: Path) -> dict[str, Any] | None:
    path = Path(run_dir) / SUMMARY_FILE
    return json.loads(path.read_text()) if path.exists() else None
