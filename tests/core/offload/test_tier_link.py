"""The processor-sharing link: upstream's worked examples, staggering, time that never rewinds."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from engined.core.offload.link import BandwidthLink

MB = 1_000_000


def test_single_transfer_finishes_at_its_duration() -> None:
    link = BandwidthLink(1.0)
    transfer = link.start(0.0, MB)
    assert link.earliest_finish() == pytest.approx(1.0)
    assert link.advance_to(0.5) == []
    assert link.earliest_finish() == pytest.approx(1.0)
    assert link.advance_to(1.0) == [transfer]
    assert link.is_idle()
    assert link.earliest_finish() is None


def test_two_transfers_on_two_gbps_both_finish_at_one_ms() -> None:
    link = BandwidthLink(2.0)
    first = link.start(0.0, MB)
    second = link.start(0.0, MB)
    assert link.earliest_finish() == 1.0
    assert link.advance_to(0.999) == []
    assert link.advance_to(1.0) == [first, second]


def test_four_transfers_on_four_gbps_all_finish_at_one_ms() -> None:
    link = BandwidthLink(4.0)
    ids = [link.start(0.0, MB) for _ in range(4)]
    assert link.earliest_finish() == 1.0
    assert sorted(link.advance_to(1.0)) == ids


def test_sharing_halves_each_rate() -> None:
    link = BandwidthLink(1.0)
    link.start(0.0, MB)
    link.start(0.0, MB)
    assert link.earliest_finish() == pytest.approx(2.0)
    assert link.advance_to(1.99) == []
    assert len(link.advance_to(2.0)) == 2


def test_staggered_arrival_shares_only_from_its_start() -> None:
    link = BandwidthLink(1.0)
    first = link.start(0.0, MB)
    assert link.advance_to(0.5) == []
    second = link.start(0.5, MB)
    assert link.earliest_finish() == pytest.approx(1.5)
    assert link.advance_to(1.5) == [first]
    assert link.earliest_finish() == pytest.approx(2.0)
    assert link.advance_to(2.0) == [second]


def test_late_arrival_after_idle_gets_the_whole_link() -> None:
    link = BandwidthLink(1.0)
    link.start(0.0, MB)
    assert len(link.advance_to(1.0)) == 1
    assert link.advance_to(5.0) == []
    later = link.start(5.0, MB)
    assert link.earliest_finish() == pytest.approx(6.0)
    assert link.advance_to(6.0) == [later]


def test_small_transfer_overtakes_a_large_one() -> None:
    link = BandwidthLink(1.0)
    big = link.start(0.0, 4 * MB)
    small = link.start(0.0, MB)
    assert link.earliest_finish() == pytest.approx(2.0)
    assert link.advance_to(2.0) == [small]
    assert link.earliest_finish() == pytest.approx(5.0)
    assert link.advance_to(10.0) == [big]


@pytest.mark.parametrize("gbps", [0.0, -3.0])
def test_non_positive_bandwidth_is_infinite(gbps: float) -> None:
    link = BandwidthLink(gbps)
    transfer = link.start(10.0, 10**12)
    assert link.earliest_finish() == 10.0
    assert link.advance_to(10.0) == [transfer]


def test_zero_bytes_complete_at_the_next_advance_at_or_after_start() -> None:
    link = BandwidthLink(1.0)
    transfer = link.start(3.0, 0)
    assert link.earliest_finish() == 3.0
    assert link.advance_to(3.0) == [transfer]


def test_time_never_rewinds() -> None:
    link = BandwidthLink(1.0)
    transfer = link.start(0.0, MB)
    assert link.advance_to(0.6) == []
    assert link.advance_to(0.2) == []
    assert link.last_ms == 0.6
    assert link.earliest_finish() == pytest.approx(1.0)
    assert link.advance_to(1.0) == [transfer]
    idle = link.start(0.5, MB)
    assert link.last_ms == 1.0
    assert link.earliest_finish() == pytest.approx(2.0)
    assert link.advance_to(2.0) == [idle]


def test_starting_in_the_future_without_advancing_is_refused() -> None:
    link = BandwidthLink(1.0)
    link.start(0.0, MB)
    with pytest.raises(RuntimeError):
        link.start(0.5, MB)


def test_simultaneous_completions_follow_swap_remove_order() -> None:
    link = BandwidthLink(3.0)
    a, b, c = (link.start(0.0, MB) for _ in range(3))
    assert link.advance_to(1.0) == [a, c, b]


def test_shared_counter_gives_distinct_ids_across_links() -> None:
    ids = itertools.count()
    one = BandwidthLink(1.0, ids)
    two = BandwidthLink(1.0, ids)
    started = [link.start(0.0, 1) for _ in range(5) for link in (one, two)]
    assert len(set(started)) == 10


@given(
    gbps=st.sampled_from([0.5, 1.0, 3.0, 14.0]),
    transfers=st.lists(
        st.tuples(st.sampled_from([0.0, 0.25, 1.0, 2.5, 4.0]), st.integers(0, 5 * MB)),
        min_size=1,
        max_size=8,
    ),
    step=st.sampled_from([0.01, 0.1, 0.37]),
)
def test_small_steps_equal_one_big_step(
    gbps: float, transfers: list[tuple[float, int]], step: float
) -> None:
    """Extra advances between events change nothing: same completions by every event time."""
    transfers.sort(key=lambda transfer: transfer[0])
    coarse = BandwidthLink(gbps)
    checkpoints: list[tuple[float, list[int], int | None]] = []
    pending = list(transfers)
    while pending or not coarse.is_idle():
        finish = coarse.earliest_finish()
        if pending and (finish is None or pending[0][0] <= finish):
            start, size = pending.pop(0)
            checkpoints.append((start, sorted(coarse.advance_to(start)), size))
            coarse.start(start, size)
        else:
            assert finish is not None
            checkpoints.append((finish, sorted(coarse.advance_to(finish)), None))
        assert all(r >= 0.0 for r in coarse.remaining_bytes())

    fine = BandwidthLink(gbps)
    now = 0.0
    for when, expected, started in checkpoints:
        seen: list[int] = []
        while now + step < when:
            now += step
            seen += fine.advance_to(now)
            assert all(r >= 0.0 for r in fine.remaining_bytes())
        now = max(now, when)
        seen += fine.advance_to(when)
        assert sorted(seen) == expected
        if started is not None:
            fine.start(when, started)
    assert fine.is_idle()
