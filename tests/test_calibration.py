"""flex's per-pair calibration: smoothed ratios, regime changes taken whole, rebased at a refit, round trips."""

from __future__ import annotations

import pytest

from flexcomm.control.calibration import Calibration


def test_one_ratio_far_off_is_smoothed_in_two_the_same_way_are_a_new_regime() -> None:
    cal = Calibration(smoothing=0.7)
    cal.observe((0, "dense16"), 1.0, 1.0, 2)
    cal.observe((0, "dense16"), 1.2, 1.0, 2)
    assert cal.of(0, "dense16") == pytest.approx(0.7 * 1.0 + 0.3 * 1.2)
    before = cal.of(0, "dense16")
    cal.observe((0, "dense16"), 10.0, 1.0, 2)  # one slow sample (or one exploration): smoothed in
    assert cal.of(0, "dense16") == pytest.approx(0.7 * before + 0.3 * 10.0)
    cal.observe((0, "dense16"), 1.0, 1.0, 2)  # not far off what kappa reads now: smoothed, no regime pending
    settled = cal.of(0, "dense16")
    cal.observe((0, "dense16"), 30.0, 1.0, 2)
    cal.observe((0, "dense16"), 0.01, 1.0, 2)  # far off twice, opposite ways: not a regime, both smoothed
    assert cal.of(0, "dense16") == pytest.approx(0.7 * (0.7 * settled + 0.3 * 30.0) + 0.3 * 0.01)
    low = cal.of(0, "dense16")
    cal.observe((0, "dense16"), 20 * low, 1.0, 2)
    cal.observe((0, "dense16"), 30 * low, 1.0, 2)  # the link changed: the second is taken whole
    assert cal.of(0, "dense16") == pytest.approx(30 * low)


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
