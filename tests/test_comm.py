"""Communication helpers that need no process group."""

from __future__ import annotations

import pytest
import torch

from flexcomm.comm.collectives import _resolving_to


def test_a_failed_collective_is_not_swallowed_by_the_result_callback() -> None:
    failed: torch.futures.Future = torch.futures.Future()
    failed.set_exception(RuntimeError("collective timed out"))
    with pytest.raises(RuntimeError, match="collective timed out"):
        failed.then(_resolving_to(torch.zeros(1))).wait()
    ok: torch.futures.Future = torch.futures.Future()
    ok.set_result(None)
    assert ok.then(_resolving_to(torch.ones(1))).wait().item() == 1.0
