"""flex's per-pair calibration: smoothed ratios, regime changes taken whole, rebased at a refit, round trips."""

from __future__ import annotations

import pytest

from flexcomm.control.calibration import Calibration


def test_ratios_are_smoothed_one_slow_sample_does_not_flip_a_pair() -> None:
    cal = Calibration(smoothing=0.7)
    cal.observe((0, "dense16"), 1.0, 1.0, 2)
    cal.observe((0, "dense16"), 10.0, 1.0, 2)  # one slow sample on a busy CPU
    assert cal.of(0, "dense16") == pytest.approx(0.7 * 1.0 + 0.3 * 10.0)
    assert cal.of(1, "dense16") == cal.of(0, "dense16")  # an unmeasured bucket borrows the mean
    assert cal.of(0, "dense") == 1.0 and cal.measured_at[(0, "dense16")] == (1.0, 2)


def test_a_refit_keeps_the_measured_prediction_of_fresh_pairs_only() -> None:
    cal = Calibration(smoothing=0.7)
    cal.observe((0, "dense"), 2.0, 1.0, 2)
    modelled = {"old": 0.010, "new": 0.005}  # the refit halves dense's modelled time
    cal.rebase(lambda b, e, d, w, params: modelled[params], "old", "new", {0})
    assert cal.of(0, "dense") * modelled["new"] == pytest.approx(2.0 * modelled["old"])
    assert cal.anchor[(0, "dense")] == pytest.approx(0.020) and cal.recent((0, "dense"))
    cal.rebase(lambda b, e, d, w, params: modelled[params], "new", "old", {0})  # not measured since: follows the model
    assert cal.of(0, "dense") == pytest.approx(4.0) and not cal.recent((0, "dense"))
    restored = Calibration(smoothing=0.7)
    restored.load_state_dict(cal.state_dict())
    assert restored.state_dict() == cal.state_dict()
