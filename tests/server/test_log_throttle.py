"""Malformed input is logged in bursts per client, with a count of the lines held back."""

from __future__ import annotations

from engined.server.control.log_throttle import MAX_KEYS, LogThrottle


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_flood_writes_a_burst_then_one_line_per_interval_with_the_count() -> None:
    clock = Clock()
    throttle = LogThrottle(burst=3, interval_s=1.0, clock=clock)
    first = [throttle.allow(b"flooder") for _ in range(1000)]
    assert first[:3] == [0, 0, 0]
    assert first[3:] == [None] * 997
    # Another client is not held back by the flooder.
    assert throttle.allow(b"other") == 0
    clock.now += 1.0
    # The next window's first line carries the count of what the last one held back.
    assert throttle.allow(b"flooder") == 997
    assert [throttle.allow(b"flooder") for _ in range(3)] == [0, 0, None]
    clock.now += 5.0
    assert throttle.allow(b"flooder") == 1


def test_remembered_clients_are_bounded() -> None:
    clock = Clock()
    throttle = LogThrottle(burst=1, interval_s=1.0, clock=clock)
    for n in range(MAX_KEYS + 10):
        assert throttle.allow(n) == 0
    assert len(throttle._windows) == MAX_KEYS
    # The oldest were forgotten: a forgotten client starts afresh.
    assert throttle.allow(0) == 0
