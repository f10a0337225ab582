"""The wider young generation of unpaced processes (engined/server/ranks/collector.py).

`YoungGeneration` is driven through a fake of the two `gc` functions it uses, so what it sets
and puts back is exact; then a daemon shows which processes get it: an unpaced one while it
serves (and CPython's setting again after), a paced one never (its collector runs instead).
"""

from __future__ import annotations

import gc
from pathlib import Path

import pytest

from engined.server.ranks.collector import UNPACED_YOUNG_THRESHOLD, YoungGeneration
from tests.server.support import ipc_config, read_while_serving
from tests.support import run


class FakeThresholds:
    def __init__(self, thresholds: tuple[int, int, int]) -> None:
        self.thresholds = thresholds
        self.sets: list[tuple[int, int, int]] = []

    def get_threshold(self) -> tuple[int, int, int]:
        return self.thresholds

    def set_threshold(self, young: int, middle: int, old: int, /) -> None:
        self.thresholds = (young, middle, old)
        self.sets.append(self.thresholds)


@pytest.mark.parametrize(
    ("found", "serving", "sets"),
    [
        # Only the young generation widens, and close puts it back.
        ((700, 10, 10), (20_000, 10, 10), [(20_000, 10, 10), (700, 10, 10)]),
        # A wider setting is kept (close restores it as found).
        ((50_000, 5, 7), (50_000, 5, 7), [(50_000, 5, 7)]),
    ],
)
def test_start_widens_and_close_puts_back(
    found: tuple[int, int, int],
    serving: tuple[int, int, int],
    sets: list[tuple[int, int, int]],
) -> None:
    fake = FakeThresholds(found)
    young = YoungGeneration(20_000, ops=fake)
    young.start()
    assert fake.thresholds == serving
    young.close()
    assert fake.thresholds == found
    assert fake.sets == sets


def test_a_second_start_keeps_what_the_first_found_and_close_is_once() -> None:
    fake = FakeThresholds((700, 10, 10))
    young = YoungGeneration(20_000, ops=fake)
    young.start()
    young.start()
    young.close()
    young.close()
    assert fake.thresholds == (700, 10, 10)
    assert fake.sets == [(20_000, 10, 10), (700, 10, 10)]


def test_close_before_start_changes_nothing() -> None:
    fake = FakeThresholds((700, 10, 10))
    YoungGeneration(20_000, ops=fake).close()
    assert fake.sets == []


def test_the_default_is_the_module_threshold() -> None:
    fake = FakeThresholds((700, 10, 10))
    young = YoungGeneration(ops=fake)
    young.start()
    assert fake.thresholds == (UNPACED_YOUNG_THRESHOLD, 10, 10)
    young.close()


@pytest.mark.parametrize(("speedup", "widened"), [(0.0, True), (1.0, False)])
def test_an_unpaced_daemon_serves_with_the_wider_young_generation(
    tmp_path: Path, speedup: float, widened: bool
) -> None:
    cfg = ipc_config(tmp_path, speedup)
    before = gc.get_threshold()
    assert before[0] < UNPACED_YOUNG_THRESHOLD  # CPython's default, or the test is moot

    try:
        serving, after = run(read_while_serving(cfg, gc.get_threshold))
    finally:
        gc.set_threshold(*before)
        gc.enable()
        gc.unfreeze()
    expected = (UNPACED_YOUNG_THRESHOLD, *before[1:]) if widened else before
    assert serving == expected
    assert after == before
