"""The one map between modelled and wall time (engined/model_clock.py)."""

from __future__ import annotations

import math

import pytest

from engined.model_clock import ModelClock


def test_paced_at_four_a_wall_second_is_four_modelled_seconds() -> None:
    clock = ModelClock(4.0)
    assert clock.paced
    assert clock.to_wall_s(1000.0) == 0.25
    assert clock.to_modelled_ms(0.25) == 1000.0
    assert clock.reported_s(0.1) == 0.025


def test_at_ratio_one_the_maps_are_the_unscaled_arithmetic_bit_for_bit() -> None:
    clock = ModelClock(1.0)
    for ms in (0.0, 16.6229144639296, 12.0890625, 1e9 + 0.1):
        assert clock.to_wall_s(ms) == ms / 1000.0
        assert clock.to_modelled_ms(ms / 7.0) == ms / 7.0 * 1000.0
        assert clock.reported_s(ms) == ms


@pytest.mark.parametrize("ratio", [0.0, -1.0, math.nan])
def test_unpaced_nothing_waits_and_the_pass_time_is_reported_unscaled(ratio: float) -> None:
    clock = ModelClock(ratio)
    assert not clock.paced
    assert clock.speedup_ratio == 0.0
    assert clock.to_wall_s(5.0) == 0.0
    assert clock.to_modelled_ms(5.0) == 0.0
    assert clock.reported_s(0.0125) == 0.0125
    assert repr(clock) == "ModelClock(speedup_ratio=0.0)"
