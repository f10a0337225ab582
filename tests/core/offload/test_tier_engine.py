"""G1 -> G2 offload: leases, PS deadlines, policies, batching, G2 events, G2 -> G3 copies."""

from __future__ import annotations

import pytest

from engined.core.offload.config import OffloadConfig
from engined.core.offload.tier_engine import TierEngine
from engined.core.offload.tier_values import RetryNow
from engined.core.types import Medium, OffloadWait
from tests.core.offload.support import (
    MB,
    described,
    engine,
    evicted,
    key,
    meta,
    removed,
    stored,
)


def test_one_block_offload_completes_at_the_ps_deadline() -> None:
    """Seed `decode_growth_waits_without_preempting`: 1 MB at 1 GB/s = 1 ms."""
    offload = engine()
    outcome = offload.enqueue_g1_evictions([evicted(7, 0)], 0.0)
    assert isinstance(outcome, OffloadWait)
    assert outcome.deadline_ms == 1.0
    assert offload.offload_wait(outcome.lease_id) == (outcome.lease_id, 1.0)
    assert offload.earliest_pending_deadline() == 1.0

    early = offload.tick(0.5)
    assert early.released_g1_slots == []
    assert early.events == []
    assert offload.offload_wait(outcome.lease_id) == (outcome.lease_id, 1.0)

    landed = offload.tick(1.0)
    assert landed.released_g1_slots == [7]
    assert landed.released_count == 1
    assert described(landed.events) == stored(Medium.CPU, 0)
    event = landed.events[0]
    assert event.block.parent_hash is None
    assert event.block.local_hash == 2000
    assert event.block.token_ids == [0, 1, 2, 3]
    assert offload.offload_wait(outcome.lease_id) is None
    assert offload.earliest_pending_deadline() is None
    assert offload.g2.contains(key(0))
    assert offload.g2.pool.num_inactive == 1
    assert offload.is_idle()


def test_offload_applied_late_starts_at_its_own_time() -> None:
    """Seed `live_destination_eviction_uses_command_application_time`: 20 MB at t=100."""
    offload = engine(block_size_bytes=20 * MB)
    outcome = offload.enqueue_g1_evictions([evicted(3, 0)], 100.0)
    assert isinstance(outcome, OffloadWait)
    assert outcome.deadline_ms == pytest.approx(120.0)
    assert offload.tick(100.0).released_g1_slots == []
    assert offload.earliest_pending_deadline() == outcome.deadline_ms
    landed = offload.tick(120.0)
    assert landed.released_g1_slots == [3]
    assert described(landed.events) == stored(Medium.CPU, 0)


def test_worker_clock_truncates_to_microseconds() -> None:
    offload = engine()
    outcome = offload.enqueue_g1_evictions([evicted(1, 0)], 0.3333333)
    assert isinstance(outcome, OffloadWait)
    assert outcome.deadline_ms == pytest.approx(1.333, abs=1e-12)


def test_block_already_in_g2_is_filtered_and_retried_now() -> None:
    """Seed `destination_reservation_retries_after_presence_filtered_offload`."""
    offload = TierEngine(OffloadConfig(block_size_tokens=4))
    offload.seed_g2(key(0))
    outcome = offload.enqueue_g1_evictions([evicted(5, 0)], 0.0)
    assert isinstance(outcome, RetryNow)
    assert outcome.released_slots == [5]
    assert outcome.effects.events == []
    assert offload.earliest_pending_deadline() is None
    assert offload.num_leases == 0


def test_block_already_in_flight_is_filtered() -> None:
    offload = engine()
    first = offload.enqueue_g1_evictions([evicted(1, 0)], 0.0)
    assert isinstance(first, OffloadWait)
    again = offload.enqueue_g1_evictions([evicted(2, 0)], 0.2)
    assert isinstance(again, RetryNow)
    assert again.released_slots == [2]
    assert offload.offload_wait(first.lease_id) == (first.lease_id, 1.0)
    landed = offload.tick(1.0)
    assert landed.released_g1_slots == [1]
    assert described(landed.events) == stored(Medium.CPU, 0)


def test_filtered_blocks_wait_for_their_lease() -> None:
    offload = engine()
    offload.seed_g2(key(1), key(0))
    outcome = offload.enqueue_g1_evictions([evicted(10, 0), evicted(11, 1)], 0.0)
    assert isinstance(outcome, OffloadWait)
    assert offload.tick(0.5).released_g1_slots == []
    assert offload.tick(1.0).released_g1_slots == [10, 11]


def test_capacity_reservation_counts_in_flight_blocks_twice() -> None:
    """Accepted blocks reserve room and also allocate it at batch start, as upstream does."""
    offload = engine(num_g2_blocks=2)
    first = offload.enqueue_g1_evictions([evicted(1, 0)], 0.0)
    assert isinstance(first, OffloadWait)
    refused = offload.enqueue_g1_evictions([evicted(2, 5)], 0.0)
    assert isinstance(refused, RetryNow)
    assert refused.released_slots == [2]
    assert offload.tick(1.0).released_g1_slots == [1]
    assert not offload.g2.contains(key(5))
    accepted = offload.enqueue_g1_evictions([evicted(3, 5)], 1.0)
    assert isinstance(accepted, OffloadWait)
    assert accepted.deadline_ms == 2.0


def test_capacity_reservation_skips_blocks_beyond_free_room() -> None:
    offload = engine(num_g2_blocks=2)
    outcome = offload.enqueue_g1_evictions([evicted(1, 0), evicted(2, 1), evicted(3, 2)], 0.0)
    assert isinstance(outcome, OffloadWait)
    assert outcome.deadline_ms == 2.0
    landed = offload.tick(2.0)
    assert landed.released_g1_slots == [1, 2, 3]
    assert described(landed.events) == stored(Medium.CPU, 0, 1)
    assert not offload.g2.contains(key(2))


def test_nothing_fits_in_a_full_pinned_g2() -> None:
    offload = engine(num_g2_blocks=1)
    offload.seed_g2(key(9))
    plan = offload.prepare_onboard([key(9)])
    assert plan is not None
    outcome = offload.enqueue_g1_evictions([evicted(4, 0)], 0.0)
    assert isinstance(outcome, RetryNow)
    assert outcome.released_slots == [4]
    offload.abandon_onboard(plan)


def test_five_blocks_in_batches_of_four_share_the_link() -> None:
    offload = engine()
    blocks = [evicted(10 + i, i) for i in range(5)]
    outcome = offload.enqueue_g1_evictions(blocks, 0.0)
    assert isinstance(outcome, OffloadWait)
    assert outcome.deadline_ms == pytest.approx(2.0)
    small = offload.tick(2.0)
    assert small.released_g1_slots == [14]
    assert described(small.events) == stored(Medium.CPU, 4)
    dependency = offload.offload_wait(outcome.lease_id)
    assert dependency is not None
    assert dependency[0] == outcome.lease_id
    assert dependency[1] == pytest.approx(5.0)
    big = offload.tick(5.0)
    assert big.released_g1_slots == [10, 11, 12, 13]
    assert described(big.events) == stored(Medium.CPU, 0, 1, 2, 3)
    assert offload.offload_wait(outcome.lease_id) is None


def test_concurrent_batches_are_capped_and_successors_start_at_the_tick() -> None:
    offload = engine(offload_batch_size=1)
    outcome = offload.enqueue_g1_evictions([evicted(1, 0), evicted(2, 1)], 0.0)
    assert isinstance(outcome, OffloadWait)
    assert outcome.deadline_ms == 1.0
    assert offload.tick(1.5).released_g1_slots == [1]
    assert offload.earliest_pending_deadline() == pytest.approx(2.5)
    assert offload.tick(2.5).released_g1_slots == [2]
    assert offload.is_idle()


def test_zero_byte_offload_blocks_until_a_tick_at_the_same_time() -> None:
    offload = TierEngine(OffloadConfig(block_size_tokens=4))
    outcome = offload.enqueue_g1_evictions([evicted(1, 0)], 7.0)
    assert isinstance(outcome, OffloadWait)
    assert outcome.deadline_ms == 7.0
    assert offload.tick(7.0).released_g1_slots == [1]


def test_g2_eviction_publishes_removed_for_blocks_with_metadata() -> None:
    offload = engine(num_g2_blocks=1)
    offload.enqueue_g1_evictions([evicted(1, 0)], 0.0)
    assert described(offload.tick(1.0).events) == stored(Medium.CPU, 0)
    offload.enqueue_g1_evictions([evicted(2, 3)], 1.0)
    landed = offload.tick(2.0)
    assert described(landed.events) == removed(Medium.CPU, 0) + stored(Medium.CPU, 3)
    assert not offload.g2.contains(key(0))


def test_seeded_and_metadata_free_blocks_publish_nothing() -> None:
    offload = engine(num_g2_blocks=1)
    offload.seed_g2(key(0))
    offload.enqueue_g1_evictions([evicted(1, 3, with_meta=False)], 0.0)
    landed = offload.tick(1.0)
    assert landed.events == []
    assert landed.released_g1_slots == [1]
    offload.enqueue_g1_evictions([evicted(2, 4)], 1.0)
    assert described(offload.tick(2.0).events) == stored(Medium.CPU, 4)


def test_reoffering_a_block_in_g2_keeps_its_removal_visible() -> None:
    """A filtered re-offer must not make the G2 copy's later eviction unpublished."""
    offload = engine(num_g2_blocks=1)
    offload.enqueue_g1_evictions([evicted(1, 0)], 0.0)
    offload.tick(1.0)
    assert isinstance(offload.enqueue_g1_evictions([evicted(2, 0)], 1.0), RetryNow)
    offload.enqueue_g1_evictions([evicted(3, 1)], 1.0)
    assert described(offload.tick(2.0).events) == removed(Medium.CPU, 0) + stored(Medium.CPU, 1)


def test_landed_blocks_are_copied_to_g3_in_the_background() -> None:
    offload = engine(num_g3_blocks=4, bandwidth_g2_to_g3_gbps=1.0)
    outcome = offload.enqueue_g1_evictions([evicted(1, 0), evicted(2, 1)], 0.0)
    assert isinstance(outcome, OffloadWait)
    landed = offload.tick(2.0)
    assert landed.released_g1_slots == [1, 2]
    assert described(landed.events) == stored(Medium.CPU, 0, 1)
    assert offload.g2.pool.num_active == 2
    assert offload.earliest_pending_deadline() == pytest.approx(4.0)
    copied = offload.tick(4.0)
    assert described(copied.events) == stored(Medium.STORAGE, 0, 1)
    assert offload.g3 is not None and offload.g3.contains(key(1))
    assert offload.g2.pool.num_active == 0
    assert offload.is_idle()


def test_g3_copies_run_one_batch_at_a_time_and_g3_evictions_publish() -> None:
    offload = engine(num_g3_blocks=1, bandwidth_g2_to_g3_gbps=1.0, offload_batch_size=1)
    offload.enqueue_g1_evictions([evicted(1, 0), evicted(2, 1)], 0.0)
    assert described(offload.tick(1.0).events) == stored(Medium.CPU, 0)
    second = offload.tick(2.0)
    assert described(second.events) == (
        stored(Medium.CPU, 1) + stored(Medium.STORAGE, 0) + removed(Medium.STORAGE, 0)
    )
    assert described(offload.tick(3.0).events) == stored(Medium.STORAGE, 1)


def test_g3_skips_blocks_it_already_holds() -> None:
    offload = engine(num_g3_blocks=4, bandwidth_g2_to_g3_gbps=1.0)
    offload.seed_g3(key(0))
    offload.enqueue_g1_evictions([evicted(1, 0)], 0.0)
    offload.tick(1.0)
    assert offload.g2.pool.num_active == 0
    assert offload.earliest_pending_deadline() is None


def test_empty_eviction_is_a_caller_error() -> None:
    with pytest.raises(ValueError):
        engine().enqueue_g1_evictions([], 0.0)


def test_meta_helper_chains_parents() -> None:
    assert meta(3).parent_hash == meta(2).seq_hash


def test_offload_onto_a_link_that_already_finished_retries_at_once() -> None:
    """Completions seen while reserving act at a tick; upstream settles and ticks at once."""
    offload = engine(offload_batch_size=1)
    first = offload.enqueue_g1_evictions([evicted(1, 0)], 0.0)
    assert isinstance(first, OffloadWait)
    second = offload.enqueue_g1_evictions([evicted(2, 1)], 2.0)
    assert isinstance(second, RetryNow)
    assert second.released_slots == [1]
    assert described(second.effects.events) == stored(Medium.CPU, 0)
    assert offload.num_leases == 1
    assert offload.earliest_pending_deadline() == 3.0
    assert offload.tick(3.0).released_g1_slots == [2]
    assert offload.is_idle()


def test_earliest_deadline_covers_completions_seen_between_ticks() -> None:
    offload = engine(bandwidth_g2_to_g1_gbps=1.0)
    offload.enqueue_g1_evictions([evicted(1, 0)], 0.0)
    offload.seed_g2(key(5))
    plan = offload.prepare_onboard([key(5)])
    assert plan is not None
    offload.start_onboard(plan, [9], [], 4.0)
    assert offload.earliest_pending_deadline() == 4.0
    assert offload.tick(4.0).released_g1_slots == [1]
    assert offload.earliest_pending_deadline() == 5.0
