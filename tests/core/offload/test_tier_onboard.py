"""G2 -> G1 onboards: PS sharing, staging G3 through G2, pins, cancellation, reaping."""

from __future__ import annotations

import pytest

from engined.core.offload.tier_values import OnboardState, OnboardStatus
from engined.core.types import Medium, OffloadWait
from tests.core.offload.support import (
    described,
    engine,
    evicted,
    key,
    parent_key,
    removed,
    stored,
)


def test_g2_hit_swaps_in_at_the_ps_deadline() -> None:
    """Seed `ready_swap_ins_drain_on_pass_entry`: 1 MB at 1 GB/s."""
    offload = engine(bandwidth_g2_to_g1_gbps=1.0)
    offload.seed_g2(key(0))
    plan = offload.prepare_onboard([key(0)])
    assert plan is not None
    assert plan.block_count == 1
    assert offload.g2.pool.num_active == 1
    onboard = offload.start_onboard(plan, [5], [], 0.0)
    assert offload.onboard_status(onboard) == OnboardStatus(OnboardState.PENDING, 1)
    assert offload.earliest_pending_deadline() == 1.0
    assert offload.tick(0.5).completed_onboards == []
    done = offload.tick(1.0)
    assert done.completed_onboards == [onboard]
    assert done.events == []
    assert offload.onboard_status(onboard) == OnboardStatus(OnboardState.COMPLETED, 1)
    assert offload.g2.pool.num_active == 1
    assert offload.take_completed_onboard(onboard) == ([5], [])
    assert offload.g2.pool.num_active == 0
    assert offload.onboard_status(onboard) is None
    assert offload.take_completed_onboard(onboard) is None
    assert offload.is_idle()


def test_two_onboards_share_two_gbps_and_finish_together_in_order() -> None:
    """Seed `completed_onboards_reenter_front_preserving_order`."""
    offload = engine(bandwidth_g2_to_g1_gbps=2.0)
    offload.seed_g2(key(0, 1))
    offload.seed_g2(key(0, 2))
    ids = []
    for slot, seq in ((10, 1), (11, 2)):
        plan = offload.prepare_onboard([key(0, seq)])
        assert plan is not None
        ids.append(offload.start_onboard(plan, [slot], [], 0.0))
    assert offload.earliest_pending_deadline() == 1.0
    assert offload.tick(0.99).completed_onboards == []
    assert offload.tick(1.0).completed_onboards == ids


def test_prefix_hit_stops_at_the_first_g2_miss() -> None:
    offload = engine(bandwidth_g2_to_g1_gbps=4.0)
    offload.seed_g2(key(0))
    offload.seed_g2(key(1), key(0))
    offload.seed_g2(key(3), key(2))
    plan = offload.prepare_onboard([key(0), key(1), key(2), key(3)])
    assert plan is not None
    assert plan.keys == [key(0), key(1)]
    offload.abandon_onboard(plan)
    assert offload.g2.pool.num_active == 0
    assert offload.prepare_onboard([key(2), key(3)]) is None
    assert offload.prepare_onboard([]) is None


def test_four_onboards_of_four_blocks_on_four_gbps_finish_at_one_ms() -> None:
    """Seed `equivalence_replayed_twice_with_g2_offload`: 4 x 4 x 250 KB on 4 GB/s."""
    offload = engine(bandwidth_g2_to_g1_gbps=4.0, block_size_bytes=250_000)
    keys = [key(i) for i in range(4)]
    for i in range(4):
        offload.seed_g2(keys[i], parent_key(i))
    ids = []
    for request in range(4):
        plan = offload.prepare_onboard(keys)
        assert plan is not None and plan.block_count == 4
        ids.append(offload.start_onboard(plan, [10 * request + i for i in range(4)], [], 0.0))
    assert offload.earliest_pending_deadline() == pytest.approx(1.0)
    assert sorted(offload.tick(1.0).completed_onboards) == ids


def test_plan_must_get_exactly_its_slots_and_is_single_use() -> None:
    offload = engine()
    offload.seed_g2(key(0))
    plan = offload.prepare_onboard([key(0)])
    assert plan is not None
    with pytest.raises(ValueError):
        offload.start_onboard(plan, [1, 2], [], 0.0)
    offload.start_onboard(plan, [1], [], 0.0)
    with pytest.raises(RuntimeError):
        offload.abandon_onboard(plan)


def test_staged_g3_hit_takes_two_hops() -> None:
    """Seed `tick_offload_only_completes_g3_staging_before_same_timestamp_admission`."""
    offload = engine(
        num_g2_blocks=8,
        num_g3_blocks=8,
        bandwidth_g2_to_g1_gbps=1.0,
        bandwidth_g3_to_g2_gbps=1.0,
    )
    offload.seed_g3(key(0))
    plan = offload.prepare_onboard([key(0)])
    assert plan is not None and plan.is_staged and plan.block_count == 1
    assert offload.g2.reserved == 1
    onboard = offload.start_onboard(plan, [3], [9], 0.0)
    assert offload.onboard_status(onboard) == OnboardStatus(OnboardState.PENDING, 0)
    assert offload.earliest_pending_deadline() == 1.0

    staged = offload.tick(1.0)
    assert staged.completed_onboards == []
    assert offload.onboard_status(onboard) == OnboardStatus(OnboardState.PENDING, 1)
    assert offload.g2.contains(key(0))
    assert offload.g2.reserved == 0
    assert offload.earliest_pending_deadline() == 2.0

    assert offload.tick(2.0).completed_onboards == [onboard]
    assert offload.take_completed_onboard(onboard) == ([3], [9])
    assert offload.g2.pool.num_active == 0
    assert offload.g3 is not None and offload.g3.pool.num_active == 0
    assert offload.is_idle()


def test_staging_moves_the_g2_prefix_and_the_g3_run_together() -> None:
    offload = engine(num_g3_blocks=8, bandwidth_g2_to_g1_gbps=1.0, bandwidth_g3_to_g2_gbps=1.0)
    offload.seed_g2(key(0))
    offload.seed_g3(key(1), key(0))
    offload.seed_g3(key(2), key(1))
    plan = offload.prepare_onboard([key(0), key(1), key(2), key(3)])
    assert plan is not None and plan.keys == [key(0), key(1), key(2)]
    onboard = offload.start_onboard(plan, [1, 2, 3], [], 0.0)
    offload.tick(2.0)
    assert offload.onboard_status(onboard) == OnboardStatus(OnboardState.PENDING, 3)
    assert offload.earliest_pending_deadline() == 5.0
    assert offload.tick(5.0).completed_onboards == [onboard]


def test_staged_blocks_publish_in_g2_only_with_metadata_g2_still_has() -> None:
    """A block evicted from G2 lost its G2 metadata; staging it back publishes no CPU Stored."""
    offload = engine(num_g3_blocks=8, num_g2_blocks=1, bandwidth_g2_to_g3_gbps=1.0)
    offload.enqueue_g1_evictions([evicted(1, 0)], 0.0)
    assert described(offload.tick(1.0).events) == stored(Medium.CPU, 0)
    assert described(offload.tick(2.0).events) == stored(Medium.STORAGE, 0)
    offload.enqueue_g1_evictions([evicted(2, 5)], 2.0)
    assert described(offload.tick(3.0).events) == removed(Medium.CPU, 0) + stored(Medium.CPU, 5)
    assert offload.prepare_onboard([key(0)]) is None
    assert described(offload.tick(4.0).events) == stored(Medium.STORAGE, 5)
    plan = offload.prepare_onboard([key(0)])
    assert plan is not None and plan.is_staged
    offload.start_onboard(plan, [8], [], 4.0)
    assert described(offload.tick(5.0).events) == removed(Medium.CPU, 5)
    assert offload.g2.contains(key(0))


def test_no_g2_room_falls_back_to_the_g2_prefix() -> None:
    offload = engine(num_g2_blocks=1, num_g3_blocks=8)
    offload.seed_g2(key(0))
    offload.seed_g3(key(1), key(0))
    holder = offload.prepare_onboard([key(0)])
    assert holder is not None and not holder.is_staged
    plan = offload.prepare_onboard([key(0), key(1)])
    assert plan is not None
    assert not plan.is_staged
    assert plan.keys == [key(0)]
    offload.abandon_onboard(plan)
    offload.abandon_onboard(holder)
    assert offload.g2.reserved == 0 and offload.g2.pool.num_active == 0


def test_staging_without_room_at_start_lands_the_g2_prefix_only() -> None:
    offload = engine(num_g2_blocks=1, num_g3_blocks=8, bandwidth_g2_to_g1_gbps=1.0)
    offload.seed_g2(key(0))
    offload.seed_g3(key(1), key(0))
    plan = offload.prepare_onboard([key(0), key(1)])
    assert plan is not None and plan.is_staged and plan.block_count == 2
    onboard = offload.start_onboard(plan, [1, 2], [], 0.0)
    assert offload.onboard_status(onboard) == OnboardStatus(OnboardState.PENDING, 1)
    assert offload.g2.reserved == 0
    assert offload.tick(1.0).completed_onboards == [onboard]
    assert offload.take_completed_onboard(onboard) == ([1, 2], [])


def test_cancel_keeps_slots_and_pins_until_the_transfer_ends() -> None:
    """Seed `cancel_parked_swap_in_releases_ownership_and_isolates_uuid_reuse`."""
    offload = engine(bandwidth_g2_to_g1_gbps=1.0)
    offload.seed_g2(key(2))
    plan = offload.prepare_onboard([key(2)])
    assert plan is not None
    onboard = offload.start_onboard(plan, [7], [0, 1], 0.0)
    assert offload.cancel_onboard(onboard)
    assert not offload.cancel_onboard(onboard)
    assert offload.onboard_status(onboard) == OnboardStatus(OnboardState.CANCELLED, 1)
    assert offload.take_completed_onboard(onboard) is None
    early = offload.tick(0.5)
    assert early.reaped_onboards == [] and early.released_count == 0
    late = offload.tick(10.0)
    assert late.completed_onboards == []
    [reaped] = late.reaped_onboards
    assert (reaped.onboard_id, reaped.slots, reaped.pins) == (onboard, [7], [0, 1])
    assert late.released_count == 3
    assert offload.onboard_status(onboard) is None
    assert offload.g2.pool.num_active == 0
    assert offload.is_idle()


def test_cancel_after_completion_reaps_at_the_next_tick() -> None:
    offload = engine(bandwidth_g2_to_g1_gbps=1.0)
    offload.seed_g2(key(0))
    plan = offload.prepare_onboard([key(0)])
    assert plan is not None
    onboard = offload.start_onboard(plan, [4], [], 0.0)
    assert offload.tick(1.0).completed_onboards == [onboard]
    assert offload.cancel_onboard(onboard)
    assert [r.slots for r in offload.tick(1.0).reaped_onboards] == [[4]]


def test_cancel_while_staging_reaps_when_staging_lands() -> None:
    offload = engine(num_g3_blocks=4, bandwidth_g3_to_g2_gbps=1.0)
    offload.seed_g3(key(0))
    plan = offload.prepare_onboard([key(0)])
    assert plan is not None
    onboard = offload.start_onboard(plan, [6], [], 0.0)
    offload.cancel_onboard(onboard)
    landed = offload.tick(1.0)
    assert [r.slots for r in landed.reaped_onboards] == [[6]]
    assert offload.g2.contains(key(0))
    assert offload.g2.pool.num_active == 0
    assert offload.earliest_pending_deadline() is None


def test_unknown_onboard_ids() -> None:
    offload = engine()
    assert offload.onboard_status(99) is None
    assert not offload.cancel_onboard(99)
    assert offload.take_completed_onboard(99) is None


def test_offload_wait_and_onboard_share_one_id_space() -> None:
    offload = engine(bandwidth_g2_to_g1_gbps=1.0)
    offload.seed_g2(key(0))
    plan = offload.prepare_onboard([key(0)])
    assert plan is not None
    onboard = offload.start_onboard(plan, [1], [], 0.0)
    outcome = offload.enqueue_g1_evictions([evicted(2, 4)], 0.0)
    assert isinstance(outcome, OffloadWait)
    assert outcome.lease_id != onboard
    assert offload.offload_wait(onboard) is None
