"""flexcomm.telemetry: exact metrics from hand-built records and decisions; FlexState.metrics() drains nothing."""

from __future__ import annotations

import math

import pytest

import flexcomm
from flexcomm import telemetry
from flexcomm.control import DensityController, ExchangeChooser
from flexcomm.exchange.job import BucketRecord


def _record(step: int, bucket: int, exchange: str, numel: int, k: int, nbytes: int, t_compress: float,
            t_exchange: float, predicted: float = math.nan, density: float = 0.01, explored: bool = False) -> BucketRecord:
    return BucketRecord(step=step, bucket=bucket, numel=numel, exchange=exchange, k=k, leader=-1,
                        t_compress=t_compress, t_exchange=t_exchange, bytes_sent=nbytes, gain=math.nan,
                        predicted=predicted, density=density, explored=explored)


def _mixed_step(step: int = 7, predicted: tuple[float, float, float] = (0.5, 0.25, 0.125)) -> list[BucketRecord]:
    """A flex step: one dense bucket of 1000 elements, AR-Topk and AG-Topk buckets of 1000 at density 0.01."""
    return [
        _record(step, 0, "dense", 1000, 1000, 4000, 0.0, 0.5, predicted[0]),
        _record(step, 1, "artopk", 1000, 10, 80, 0.25, 0.25, predicted[1]),
        _record(step, 2, "agtopk", 1000, 10, 80, 0.125, 0.125, predicted[2], explored=True),
    ]


def test_step_metrics_of_a_mixed_step() -> None:
    assert telemetry.step_metrics(_mixed_step()) == {
        "flexcomm/step": 7,
        "flexcomm/density": 0.01,
        "flexcomm/sent_fraction": 1020 / 3000,
        "flexcomm/share_dense": 1 / 3,
        "flexcomm/share_dense16": 0.0,
        "flexcomm/share_agtopk": 1 / 3,
        "flexcomm/share_artopk": 1 / 3,
        "flexcomm/share_lowrank": 0.0,
        "flexcomm/share_explored": 1 / 3,
        "flexcomm/bytes_sent": 4160,
        "flexcomm/exchange_time_s": 1.25,
        "flexcomm/predicted_exchange_time_s": 0.875,
    }


def test_all_dense_step_has_density_one_and_no_prediction_without_a_model() -> None:
    records = [_record(3, b, "dense", 500, 500, 2000, 0.0, 0.25) for b in range(2)]
    assert telemetry.step_metrics(records) == {
        "flexcomm/step": 3,
        "flexcomm/density": 1.0,
        "flexcomm/sent_fraction": 1.0,
        "flexcomm/share_dense": 1.0,
        "flexcomm/share_dense16": 0.0,
        "flexcomm/share_agtopk": 0.0,
        "flexcomm/share_artopk": 0.0,
        "flexcomm/share_lowrank": 0.0,
        "flexcomm/share_explored": 0.0,
        "flexcomm/bytes_sent": 4000,
        "flexcomm/exchange_time_s": 0.5,
    }
    assert telemetry.step_metrics([]) == {}


def test_quality_is_the_mean_over_the_buckets_that_measured_it() -> None:
    records = _mixed_step()
    records[1].exchange, records[1].quality = "lowrank", 0.5
    records[2].exchange, records[2].quality = "lowrank", 0.75
    values = telemetry.step_metrics(records)
    assert values["flexcomm/quality"] == 0.625 and values["flexcomm/share_lowrank"] == 2 / 3
    assert "flexcomm/quality" not in telemetry.step_metrics(_mixed_step())


def test_newest_step_is_the_tail_that_shares_the_last_step() -> None:
    older, newest = _mixed_step(step=4), _mixed_step(step=5)
    assert telemetry.newest_step(older + newest) == newest
    restarted = _mixed_step(step=2)  # a restored checkpoint counts steps from an earlier point
    assert telemetry.newest_step(older + restarted) == restarted
    assert telemetry.newest_step([]) == []


def _decided_controller() -> DensityController:
    controller = DensityController(candidates=(1.0, 0.1, 0.01), rule="goodput", warmup_steps=0, ramp_steps=1)
    # Goodput gain**2 / seconds: 1/2 = 0.5, 0.81/0.5 = 1.62, 0.25/0.25 = 1.0 -> density 0.1.
    # Density 0.01's gain 0.5 is under the default accuracy floor (min_gain 0.7): it leaves the front.
    controller.update(step=4, gains=[1.0, 0.9, 0.5], seconds=[2.0, 0.5, 0.25])
    return controller


def test_auto_metrics_and_reason_give_the_last_decision() -> None:
    controller = _decided_controller()
    assert controller.density == 0.1
    assert telemetry.auto_metrics(controller) == {
        "flexcomm/auto/decision_step": 4,
        "flexcomm/auto/gain": 0.9,
        "flexcomm/auto/predicted_step_s": 0.5,
        "flexcomm/auto/densest_step_s": 2.0,
        "flexcomm/auto/floor": 0.01,
    }
    assert telemetry.decision_reason(controller) == (
        "step 4: density 0.1 by rule goodput (gain 0.90, predicted step 500.0 ms; density 1 predicted 2000.0 ms); "
        "front 1, 0.1; ramp floor 0.01"
    )


def test_no_decision_no_keys() -> None:
    assert telemetry.auto_metrics(None) == {}
    assert telemetry.auto_metrics(DensityController()) == {}
    assert telemetry.decision_reason(DensityController()) is None
    assert telemetry.flex_metrics(ExchangeChooser()) == {}


def test_flex_metrics_are_the_guards_step_periods() -> None:
    chooser = ExchangeChooser()
    chooser.observe_steps(step=20, dense=0.3, other=0.2)
    assert telemetry.flex_metrics(chooser) == {"flexcomm/flex/dense_step_s": 0.3, "flexcomm/flex/plan_step_s": 0.2}


@pytest.mark.parametrize("compressor", ["artopk-star", "flex"])
def test_state_metrics_read_without_draining(compressor: str) -> None:
    state = flexcomm.FlexState(compressor=compressor, density=0.01)
    assert state.metrics() == {}
    records = _mixed_step(step=0) + _mixed_step(step=1)
    state.records.extend(records)
    assert state.metrics() == telemetry.step_metrics(records[3:])
    assert state.drain_records() == records  # metrics() took none of them
    assert state.metrics() == {}
    assert telemetry.metrics(state, records[:3]) == telemetry.step_metrics(records[:3])  # an app that drained


def test_every_key_is_documented() -> None:
    controller = _decided_controller()
    chooser = ExchangeChooser()
    chooser.observe_steps(step=20, dense=0.3, other=0.2)
    keys = {**telemetry.step_metrics(_mixed_step()), **telemetry.flex_metrics(chooser),
            **telemetry.auto_metrics(controller)}
    assert all(f"``{key}``" in telemetry.__doc__ for key in keys)


def test_write_scalars_reach_a_tensorboard_event_file(tmp_path) -> None:
    pytest.importorskip("tensorboard", reason="needs the tensorboard extra: pip install flexcomm[tensorboard]")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from torch.utils.tensorboard import SummaryWriter

    state = flexcomm.FlexState(compressor="flex", density=0.01)
    state.records.extend(_mixed_step(step=4) + _mixed_step(step=5))
    with SummaryWriter(str(tmp_path)) as writer:
        written = telemetry.write_scalars(writer, state)
        telemetry.write_scalars(writer, state, global_step=99)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert set(events.Tags()["scalars"]) == set(written) == set(telemetry.step_metrics(_mixed_step(step=5)))
    shares = events.Scalars("flexcomm/share_agtopk")
    assert [(e.step, e.value) for e in shares] == [(5, pytest.approx(1 / 3)), (99, pytest.approx(1 / 3))]
    assert events.Scalars("flexcomm/bytes_sent")[0].value == 4160
