"""The files a rank leaves in the run directory for its launcher: the start marker and its error.

The worker (:mod:`flexcomm.train.worker`) writes them; the launcher (:mod:`flexcomm.train.job`)
and the benchmarks read them.  Nothing else passes between a rank and the launcher.
"""

from __future__ import annotations

import json
import time
import traceback
from pathlib import Path

#: Rank 0 creates this once every rank is ready to train; the launcher starts the bandwidth schedule then.
STARTED_MARKER = ".training-started"
#: Rank 0 holds this while the ranks evaluate; the bandwidth schedule stands still meanwhile.
EVALUATING_MARKER = ".evaluating"


def error_file(run_dir: Path, rank: int) -> Path:
    return Path(run_dir) / f"error-rank{rank}.json"


def write_error(run_dir: Path, rank: int, exc: BaseException) -> None:
    """Record why ``rank`` failed (with the traceback of the exception being handled)."""
    info = {
        "rank": rank,
        "time": time.time(),
        "error": describe(exc),
        "traceback": traceback.format_exc(),
    }
    error_file(run_dir, rank).write_text(json.dumps(info, indent=2) + "\n")


def describe(exc: BaseException) -> str:
    """The error, with what gloo's terse timeout messages ("Application timeout caused pair
    closure", "Timed out waiting ...") mean for the run."""
    text = f"{type(exc).__name__}: {exc}"
    if "timeout" in str(exc).lower() or "timed out" in str(exc).lower():
        text += " (a peer did not answer within the process-group timeout, --timeout: it stopped, hung or lost its link)"
    return text
