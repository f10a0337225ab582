"""Twins of the seed's `offload` module (13 tests), with the seed's numbers.

mocker-1.3.0.md §9.7 lists the mechanics each test exercises. The seed builds its offload
engine on a tokio runtime and seeds G2/G3 through kvbm `BlockManager`s; here the engine is
pure (`TierEngine`) and `seed_g2`/`seed_g3` place the same metadata-free inactive blocks.
`core.kv.use`/`deref` stand for the seed's `kv_manager.process(&MoveBlock)`.
"""

from __future__ import annotations

from typing import Any

import pytest

from engined.core.args import WorkerType
from engined.core.errors import CoreError
from engined.core.offload.config import OffloadConfig
from engined.core.offload.tier_engine import TierEngine
from engined.core.scheduler import VllmCore
from engined.core.sequence import Deref
from engined.core.state import RequestStatus
from engined.core.types import (
    APPLIED,
    BlockRemoved,
    BlockStored,
    CancelDestination,
    CancelSource,
    DestinationAccepted,
    DestinationReserved,
    Medium,
    Request,
    ReserveDestination,
    Submit,
    SubmitHandoffPrefill,
)
from tests.core.factories import MOCKER_1_3_0, make_args, request, uid

MB = 1_000_000
# Four seed tests park a prompt exactly as long as the whole G1 pool (1 block for 4 tokens,
# 3 blocks for 12) with max_output_tokens 2. engined rejects a prompt at or beyond the pool's
# capacity when it must generate (README "Faithfulness": vLLM caps max_model_len at the pool;
# 1.3.0 would let it preempt itself forever), so those prompts ask for no output instead.
# Nothing the tests assert depends on the output length: they park, pin and admit.
FULL_POOL_MAX_TOKENS = 0


def core_with(**overrides: Any) -> VllmCore:
    """The seed's builder: bs 4, budget 64, chunked prefill, no time scaling."""
    fields: dict[str, Any] = {
        "block_size": 4,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 4,
        "enable_chunked_prefill": True,
        "speedup_ratio": 0.0,
    }
    fields.update(overrides)
    return VllmCore(make_args(**fields))


def engine_with(**config: Any) -> TierEngine:
    """`MockTierEngine::new(config)` then `engine.tick(0.0)`, as the seed's tests do."""
    engine = TierEngine(OffloadConfig(**config))
    engine.tick(0.0)
    return engine


def seed_g2_blocks(core: VllmCore, engine: TierEngine, request_id: str, start: int = 0) -> None:
    """Place the request's full blocks from `start` in G2, inactive and without metadata."""
    seq = core.state.requests[request_id].seq
    for key, parent in zip(seq.keys[start:], seq.parent_keys[start:], strict=True):
        engine.seed_g2(key, parent)


def seed_g3_blocks(core: VllmCore, engine: TierEngine, request_id: str) -> None:
    seq = core.state.requests[request_id].seq
    for key, parent in zip(seq.keys, seq.parent_keys, strict=True):
        engine.seed_g3(key, parent)


def insert_running_request(
    core: VllmCore, request_id: str, tokens: list[int] | range, max_output_tokens: int
) -> None:
    """A running request whose whole prompt is allocated and computed (caching off)."""
    req = core.make_request_state(
        request(request_id, tokens, max_output_tokens), request_id, RequestStatus.RUNNING
    )
    seq = req.seq
    use = seq.prepare_allocation(len(seq))
    assert use is not None, "running test request must need initial KV"
    assert core.kv.use(use)
    seq.num_allocated_tokens = len(seq)
    req.num_computed_tokens = len(seq)
    state = core.state
    state.requests[request_id] = req
    state.running.append(request_id)
    state.running_members.add(request_id)


def seed_inactive_g1_block(core: VllmCore) -> None:
    """One registered inactive G1 block: 4 tokens 10000..10003, allocated then freed."""
    seq = core.make_request_state(
        request("cache-seed", range(10_000, 10_004), 1), "cache-seed", RequestStatus.WAITING
    ).seq
    use = seq.prepare_allocation(len(seq))
    assert use is not None and use.num_blocks == 1
    assert core.kv.use(use)
    seq.num_allocated_tokens = len(seq)
    assert core.kv.apply_all(seq.free_moves())
    assert core.kv.num_inactive_blocks() == 1


def attach_g1_offload_engine(core: VllmCore) -> None:
    """1 MB blocks over a 1 GB/s G1->G2 link in batches of 4: one block offload is 1 ms."""
    engine = TierEngine(
        OffloadConfig(
            block_size_tokens=core.block_size,
            block_size_bytes=MB,
            bandwidth_g1_to_g2_gbps=1.0,
            offload_batch_size=4,
        )
    )
    engine.tick(0.0)
    core.attach_offload_engine(engine)


def signals_of(result: Any, request_id: str) -> list[Any]:
    return [s for s in result.output_signals if s.request_id == request_id]


def test_decode_growth_waits_without_preempting() -> None:
    core = core_with(num_gpu_blocks=3, enable_prefix_caching=False, worker_type=WorkerType.DECODE)
    seed_inactive_g1_block(core)
    blocked, unrelated = uid(701), uid(702)
    insert_running_request(core, blocked, range(4), 8)
    insert_running_request(core, unrelated, range(100, 102), 8)
    attach_g1_offload_engine(core)

    blocked_pass = core.execute_pass(0.0)
    assert not signals_of(blocked_pass, blocked), "the blocked decode token must not be emitted"
    assert signals_of(blocked_pass, unrelated), "the unrelated running request should continue"
    state = core.state.requests[blocked]
    assert state.seq.generated == 0
    assert state.seq.num_allocated_tokens == 4
    assert state.num_computed_tokens == 4
    dependency = state.offload_wait
    assert dependency is not None, "decode growth must retain its exact offload dependency"
    deadline = dependency.deadline_ms
    assert deadline is not None, "active offload dependency must expose a virtual deadline"
    assert deadline == 1.0
    other = core.state.requests[unrelated]
    assert other.status is RequestStatus.RUNNING
    assert other.num_preemptions == 0
    assert core.state.preemptions_total == 0

    core.tick_offload_only(deadline)
    resumed = core.execute_pass(deadline)
    assert signals_of(resumed, blocked), "decode must resume after its offload terminates"
    state = core.state.requests[blocked]
    assert state.seq.generated == 1
    assert state.seq.num_allocated_tokens == 5
    assert state.offload_wait is None
    assert core.state.preemptions_total == 0


def test_speculative_decode_reservation_waits_without_preempting() -> None:
    core = core_with(
        num_gpu_blocks=5,
        enable_prefix_caching=False,
        worker_type=WorkerType.DECODE,
        aic_nextn=5,
        aic_nextn_accept_rates="1,1,1,1,1",
    )
    seed_inactive_g1_block(core)
    blocked, unrelated = uid(711), uid(712)
    insert_running_request(core, blocked, range(4), 8)
    insert_running_request(core, unrelated, range(100, 102), 8)
    attach_g1_offload_engine(core)

    blocked_pass = core.execute_pass(0.0)
    assert not blocked_pass.output_signals, "no burst may begin before the full reservation"
    for request_id in (blocked, unrelated):
        req = core.state.requests[request_id]
        assert req.seq.generated == 0
        assert req.num_preemptions == 0
        assert req.status is RequestStatus.RUNNING
        assert req.offload_wait is not None
    dependency = core.state.requests[blocked].offload_wait
    assert dependency is not None
    deadline = dependency.deadline_ms
    assert deadline is not None, "active offload dependency must expose a virtual deadline"
    assert core.state.preemptions_total == 0

    core.tick_offload_only(deadline)
    resumed = core.execute_pass(deadline)
    assert len(signals_of(resumed, blocked)) == 6
    assert len(signals_of(resumed, unrelated)) == 6
    for request_id in (blocked, unrelated):
        req = core.state.requests[request_id]
        assert req.seq.generated == 6
        assert req.num_preemptions == 0
        assert req.offload_wait is None
    assert core.state.preemptions_total == 0


def test_execute_pass_ticks_offload_engine_when_attached() -> None:
    core = core_with(num_gpu_blocks=8, enable_prefix_caching=False)
    core.attach_offload_engine(TierEngine(OffloadConfig()))
    assert core.earliest_offload_deadline() is None
    core.execute_pass(0.0)
    core.execute_pass(10.0)
    assert core.earliest_offload_deadline() is None


def test_live_destination_eviction_uses_command_application_time() -> None:
    block_size = 4
    core = VllmCore(
        make_args(
            num_gpu_blocks=2,
            block_size=block_size,
            max_num_batched_tokens=64,
            max_num_seqs=2,
            enable_chunked_prefill=True,
            enable_prefix_caching=True,
            speedup_ratio=0.0,
        ),
        worker_id=7,
    )
    engine = TierEngine(
        OffloadConfig(
            block_size_tokens=block_size, block_size_bytes=20 * MB, bandwidth_g1_to_g2_gbps=1.0
        )
    )
    engine.tick(0.0)
    core.attach_offload_engine(engine)

    cached = uid(1)
    core.receive(request(cached, range(block_size), 1))
    now_ms = 0.0
    completed = False
    for _ in range(4):
        result = core.execute_pass(now_ms)
        now_ms = result.end_ms
        if any(s.request_id == cached and s.completed for s in result.output_signals):
            completed = True
            break
    assert completed, "cache seed request should complete normally"
    assert core.kv.num_active_blocks() == 0
    assert core.kv.num_inactive_blocks() == 1
    core.take_kv_events()

    blocker = uid(3)
    core.receive(request(blocker, [9] * (block_size - 1), 100))
    blocker_pass = core.execute_pass(now_ms)
    assert any(s.request_id == blocker and not s.completed for s in blocker_pass.output_signals)
    assert core.kv.num_active_blocks() == 1
    assert core.kv.num_inactive_blocks() == 1

    handoff_id = uid(2)
    effects = core.apply_live_command(
        ReserveDestination(handoff_id, request(uid(2), range(block_size, 2 * block_size), 1)),
        True,
        100.0,
    )
    assert effects.lifecycle_events == []

    deadline = core.earliest_offload_deadline()
    assert deadline is not None, "reservation eviction should schedule G1 to G2 offload"
    assert abs(deadline - 120.0) < 0.01, (
        f"20 ms transfer applied at t=100 should finish near t=120, got {deadline}"
    )
    core.tick_offload_only(100.0)
    assert core.kv.num_active_blocks() == 2, "the blocker and the offload source both occupy G1"
    assert core.earliest_offload_deadline() == deadline

    transport = core.tick_offload_transport_only(deadline)
    assert transport.lifecycle_events == []
    assert any(isinstance(e, BlockStored) and e.medium is Medium.CPU for e in transport.kv_events)
    assert core.kv.num_active_blocks() == 1
    assert core.destination_block_ids(handoff_id) == []

    reserved = core.retry_pending_destinations()
    assert any(
        isinstance(e, DestinationReserved) and e.handoff_id == handoff_id and e.request_id == uid(2)
        for e in reserved
    )
    assert core.destination_block_ids(handoff_id) != []


def test_ready_swap_ins_drain_on_pass_entry() -> None:
    core = core_with(num_gpu_blocks=8, enable_prefix_caching=True)
    engine = engine_with(block_size_tokens=4, block_size_bytes=MB, bandwidth_g2_to_g1_gbps=1.0)
    core.receive(request("hit", range(4), 2))
    assert len(core.state.requests["hit"].seq.keys) == 1, "one full block"
    seed_g2_blocks(core, engine, "hit")
    core.attach_offload_engine(engine)

    first = core.execute_pass(0.0)
    assert first.admissions == [], "parked swap-in should not admit in the same pass"
    assert len(core.requests_awaiting_swap_in) == 1, "request must be parked on swap-in"

    core.execute_pass(0.5)
    assert len(core.requests_awaiting_swap_in) == 1, "pending swap-in must survive"

    core.execute_pass(1.0)
    assert core.requests_awaiting_swap_in == [], "completed swap-in must drain on pass entry"


def test_g2_swap_in_reserves_destination_slot_before_transfer() -> None:
    core = core_with(num_gpu_blocks=1, max_num_seqs=2, enable_prefix_caching=True)
    engine = engine_with(block_size_tokens=4, block_size_bytes=MB, bandwidth_g2_to_g1_gbps=1.0)
    core.receive(request("hit", range(4), FULL_POOL_MAX_TOKENS))
    core.receive(request("cold", range(4, 8), FULL_POOL_MAX_TOKENS))
    assert len(core.state.requests["hit"].seq.keys) == 1
    seed_g2_blocks(core, engine, "hit")
    core.attach_offload_engine(engine)

    result = core.execute_pass(0.0)
    assert len(core.requests_awaiting_swap_in) == 1, "G2 hit should be parked on swap-in"
    assert core.kv.num_active_blocks() == 1, "parked swap-in must pin one destination G1 slot"
    assert result.admissions == [], "the cold request must not take the reserved slot"
    assert "cold" in core.state.waiting, "cold request should remain waiting for G1 capacity"


def test_tick_offload_only_completes_g3_staging_before_same_timestamp_admission() -> None:
    core = core_with(num_gpu_blocks=1, max_num_seqs=1, enable_prefix_caching=True)
    engine = engine_with(
        block_size_tokens=4,
        block_size_bytes=MB,
        num_g2_blocks=8,
        num_g3_blocks=8,
        bandwidth_g2_to_g1_gbps=1.0,
        bandwidth_g3_to_g2_gbps=1.0,
    )
    core.receive(request("hit", range(4), FULL_POOL_MAX_TOKENS))
    assert len(core.state.requests["hit"].seq.keys) == 1
    seed_g3_blocks(core, engine, "hit")
    core.attach_offload_engine(engine)

    parked = core.execute_pass(0.0)
    assert parked.admissions == []
    assert len(core.requests_awaiting_swap_in) == 1

    core.tick_offload_only(1.0)
    assert len(core.requests_awaiting_swap_in) == 1, "G3->G2 completion starts the G2->G1 hop"

    core.tick_offload_only(2.0)
    assert core.requests_awaiting_swap_in == [], "G2->G1 completion requeues before admission"

    admitted = core.execute_pass(2.0)
    assert len(admitted.admissions) == 1
    assert admitted.admissions[0].reused_input_tokens == 4


def cache_prefix_in_g1(core: VllmCore, request_id: str, blocks: int) -> None:
    """The seed's manual `Use` of the first `blocks` blocks, then `Deref` of them: inactive."""
    seq = core.state.requests[request_id].seq
    use = seq.prepare_allocation(blocks * core.block_size)
    assert use is not None and use.num_blocks == blocks
    assert core.kv.use(use)
    core.kv.deref(Deref(None, list(use.hashes)))


def test_partial_g2_swap_in_pins_cached_g1_prefix() -> None:
    core = core_with(num_gpu_blocks=3, enable_prefix_caching=True)
    engine = engine_with(block_size_tokens=4, block_size_bytes=MB, bandwidth_g2_to_g1_gbps=1.0)
    core.receive(request("partial", range(12), FULL_POOL_MAX_TOKENS))
    cache_prefix_in_g1(core, "partial", 2)
    assert len(core.state.requests["partial"].seq.keys) == 3
    seed_g2_blocks(core, engine, "partial", start=2)
    core.attach_offload_engine(engine)

    result = core.execute_pass(0.0)
    assert result.admissions == []
    assert len(core.requests_awaiting_swap_in) == 1
    assert core.kv.num_active_blocks() == 3, "two pinned prefix blocks plus one destination slot"


def test_cancel_parked_swap_in_releases_ownership_and_isolates_uuid_reuse() -> None:
    block_size = 4
    core = core_with(num_gpu_blocks=3, enable_prefix_caching=True)
    engine = engine_with(
        block_size_tokens=block_size, block_size_bytes=MB, bandwidth_g2_to_g1_gbps=1.0
    )
    parked_id, source_handoff = uid(1), uid(10)
    submitted = core.apply_command(
        SubmitHandoffPrefill(
            source_handoff, request(parked_id, range(3 * block_size), FULL_POOL_MAX_TOKENS)
        )
    )
    assert submitted.request_id == parked_id  # type: ignore[union-attr]
    cache_prefix_in_g1(core, parked_id, 2)
    seed_g2_blocks(core, engine, parked_id, start=2)
    core.attach_offload_engine(engine)

    core.execute_pass(0.0)
    assert len(core.requests_awaiting_swap_in) == 1
    assert core.kv.num_active_blocks() == 3
    with pytest.raises(CoreError):
        core.apply_command(Submit(request(parked_id, [9] * block_size, 1)))

    follower_handoff = uid(20)
    reserve = core.apply_command_effects(
        ReserveDestination(follower_handoff, request(uid(2), [7] * block_size, 1)), True
    )
    assert reserve.lifecycle_events == []

    canceled = core.apply_command_effects(CancelSource(source_handoff), True)
    assert canceled.result == APPLIED
    assert core.requests_awaiting_swap_in == []
    assert parked_id not in core.state.requests
    assert canceled.lifecycle_events == [], (
        "a cancelled swap-in keeps its prefix pins and destination until the transfer ends"
    )

    assert core.apply_command(CancelDestination(follower_handoff)) == APPLIED
    assert core.kv.num_active_blocks() == 3, "pins and destination of the cancelled swap-in stay"
    core.tick_offload_only(0.5)
    assert core.kv.num_active_blocks() == 3

    assert core.receive(request(parked_id, [99] * block_size, 1)) == parked_id
    core.tick_offload_only(10.0)
    assert core.kv.num_active_blocks() == 0
    assert core.requests_awaiting_swap_in == []
    assert parked_id in core.state.requests
    replacement = core.execute_pass(10.0)
    assert any(a.request_id == parked_id for a in replacement.admissions)


def test_completed_onboards_reenter_front_preserving_order() -> None:
    core = core_with(num_gpu_blocks=2, max_num_seqs=2, enable_prefix_caching=True)
    engine = engine_with(block_size_tokens=4, block_size_bytes=MB, bandwidth_g2_to_g1_gbps=2.0)
    first_hit, second_hit, cold = uid(1), uid(2), uid(3)
    core.receive(request(first_hit, range(4), 2))
    core.receive(request(second_hit, range(4, 8), 2))
    core.receive(request(cold, range(8, 12), 2))
    for request_id in (first_hit, second_hit):
        assert len(core.state.requests[request_id].seq.keys) == 1
        seed_g2_blocks(core, engine, request_id)
    core.attach_offload_engine(engine)

    first = core.execute_pass(0.0)
    assert first.admissions == [], "both G2 hits park; the cold request has no free G1 slot"
    assert len(core.requests_awaiting_swap_in) == 2
    assert list(core.state.waiting) == [cold], "only the cold request should remain waiting"

    # Both 1 MB transfers share a 2 GB/s link: 1 GB/s each, both finish at 1 ms.
    second = core.execute_pass(1.0)
    assert [a.request_id for a in second.admissions] == [first_hit, second_hit], (
        "completed swap-ins re-enter ahead of cold requests, in park order"
    )


def test_cold_request_with_g2_prefix_swaps_in_then_admits() -> None:
    block_size = 4
    # The whole aligned prompt is reused: 1.3.0's rule (vLLM's would report 12).
    core = core_with(num_gpu_blocks=16, enable_prefix_caching=True, prefix_hit_rule=MOCKER_1_3_0)
    # 250 KB per block x 4 blocks at 1 GB/s = a 1.0 ms swap-in.
    engine = engine_with(
        block_size_tokens=block_size, block_size_bytes=250_000, bandwidth_g2_to_g1_gbps=1.0
    )
    core.receive(request("cold", range(4 * block_size), 2))
    assert core.state.requests["cold"].seq.keys, "test sequence must have full blocks"
    seed_g2_blocks(core, engine, "cold")
    core.attach_offload_engine(engine)

    first = core.execute_pass(0.0)
    assert len(core.requests_awaiting_swap_in) == 1, "request must be parked on swap-in"
    assert first.admissions == [], "no admission should fire while parked"

    core.execute_pass(0.5)
    assert len(core.requests_awaiting_swap_in) == 1

    third = core.execute_pass(2.0)
    assert core.requests_awaiting_swap_in == [], "swap-in must drain"
    assert len(third.admissions) == 1, "promoted request must be admitted in the same pass"
    admission = third.admissions[0]
    assert admission.request_id == "cold"
    assert admission.reused_input_tokens > 0, "swapped-in prefix counts as reused tokens"
    assert admission.reused_input_tokens == 4 * block_size


def run_g2_trace() -> tuple[list[tuple[int, int]], int, int, int]:
    """4 G2-hit requests sharing a 16-token prompt and 1 cold one, at fixed timestamps."""
    block_size, num_blocks = 4, 4
    tokens_per_request = block_size * num_blocks
    core = core_with(
        num_gpu_blocks=32,
        max_num_batched_tokens=256,
        max_num_seqs=8,
        enable_prefix_caching=True,
    )
    # 4 swap-ins x 4 blocks x 250 KB on a 4 GB/s link: 1 GB/s each, all done at 1.0 ms.
    engine = engine_with(
        block_size_tokens=block_size, block_size_bytes=250_000, bandwidth_g2_to_g1_gbps=4.0
    )
    shared = list(range(tokens_per_request))
    ids = [uid(1000 + i) for i in range(4)] + [uid(2000)]
    for request_id in ids[:4]:
        core.receive(request(request_id, shared, 2))
    core.receive(request(ids[4], range(tokens_per_request, 2 * tokens_per_request), 2))
    seed_g2_blocks(core, engine, ids[0])
    core.attach_offload_engine(engine)

    admissions: list[tuple[int, int]] = []
    stored = removed = swap_in_admissions = 0
    for ts in (0.0, 0.5, 0.8, 1.5, 3.0):
        parked_before = len(core.requests_awaiting_swap_in)
        result = core.execute_pass(ts)
        swap_in_admissions += max(parked_before - len(core.requests_awaiting_swap_in), 0)
        admissions.extend(
            (ids.index(a.request_id), a.reused_input_tokens) for a in result.admissions
        )
        stored += sum(isinstance(e, BlockStored) for e in result.kv_events)
        removed += sum(isinstance(e, BlockRemoved) for e in result.kv_events)
    return admissions, stored, removed, swap_in_admissions


def test_equivalence_replayed_twice_with_g2_offload() -> None:
    first = run_g2_trace()
    second = run_g2_trace()
    assert first[3] > 0, "the trace must exercise at least one G2 swap-in admission"
    assert first == second, f"replayed G2-offload trace must be deterministic: {first} {second}"


def test_destination_reservation_retries_after_presence_filtered_offload() -> None:
    block_size = 4
    core = core_with(num_gpu_blocks=2, max_num_seqs=2, enable_prefix_caching=True)
    cached = uid(1)
    core.receive(request(cached, range(block_size), 1))
    cached_seq = core.state.requests[cached].seq
    cached_keys = list(zip(cached_seq.keys, cached_seq.parent_keys, strict=True))
    now_ms = 0.0
    completed = False
    for _ in range(4):
        result = core.execute_pass(now_ms)
        now_ms = result.end_ms
        if any(s.request_id == cached and s.completed for s in result.output_signals):
            completed = True
            break
    assert completed, "cache seed request should complete"
    assert core.kv.num_active_blocks() == 0
    assert core.kv.num_inactive_blocks() == 1

    engine = TierEngine(OffloadConfig(block_size_tokens=block_size))
    engine.tick(now_ms)
    for key, parent in cached_keys:
        engine.seed_g2(key, parent)
    core.attach_offload_engine(engine)

    handoff_id = request_id = uid(2)
    effects = core.apply_command_effects(
        ReserveDestination(
            handoff_id,
            Request(
                token_ids=list(range(block_size, 3 * block_size)),
                max_tokens=1,
                request_id=request_id,
            ),
        ),
        True,
    )
    assert effects.result == DestinationAccepted(request_id)
    assert core.earliest_offload_deadline() is None
    assert any(
        isinstance(e, DestinationReserved)
        and e.handoff_id == handoff_id
        and e.request_id == request_id
        for e in effects.lifecycle_events
    )
    assert core.destination_is_held(handoff_id)
    assert len(core.destination_block_ids(handoff_id)) == 2


# --- beyond the seed ------------------------------------------------------------------------


def test_offloaded_block_is_published_per_tier_with_its_gpu_identity() -> None:
    """Evicted from G1: GPU Removed, then (at the copy's deadline) CPU Stored with the same
    hash, parent, local hash and tokens the GPU Stored had."""
    core = VllmCore(
        make_args(
            num_gpu_blocks=2,
            max_num_seqs=1,
            enable_prefix_caching=True,
            num_g2_blocks=4,
            kv_bytes_per_token=250_000,
            bandwidth_g1_to_g2_gbps=1.0,
        )
    )
    assert core.kv.offload is not None, "num_g2_blocks and kv_bytes_per_token attach the tiers"
    core.receive(request("first", range(8), 0))
    gpu_stored = [e for e in core.execute_pass(0.0).kv_events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in gpu_stored] == [2]
    (stored,) = gpu_stored
    core.receive(request("second", range(100, 104), 0))
    evicting = core.execute_pass(1.0)
    removed = [e for e in evicting.kv_events if isinstance(e, BlockRemoved)]
    assert [(e.medium, e.block_hashes) for e in removed] == [(Medium.GPU, [stored.block_hashes[1]])]
    assert evicting.admissions == [], "the admission waits for the evicted block's copy"
    deadline = core.earliest_offload_deadline()
    assert deadline == 2.0, "1 MB at 1 GB/s, started at the pass's time"
    landed = core.tick_offload_only(deadline).kv_events
    (cpu,) = [e for e in landed if isinstance(e, BlockStored)]
    assert cpu.medium is Medium.CPU
    assert (cpu.parent_hash, cpu.block_hashes) == (stored.block_hashes[0], stored.block_hashes[1:])
    assert cpu.local_hashes == stored.local_hashes[1:]
    assert cpu.token_ids == stored.token_ids[4:]
    assert [a.request_id for a in core.execute_pass(deadline).admissions] == ["second"]
    assert core.metrics().g2_inactive_blocks == 1


def test_a_preempted_request_is_not_readmitted_onto_blocks_freed_for_a_waiter() -> None:
    """NOTE: engined deviation (scheduler `_running_waits_on_offload`). r0's MTP reservation
    preempts r1 and evicts r1's blocks, which must be copied to G2 first. Upstream re-admits r1
    onto them in the next pass, before r0's emission, and the two livelock. Here admission waits
    for the pass in which r0's offload ends, r0 bursts, and both complete."""
    core = VllmCore(
        make_args(
            num_gpu_blocks=4,
            block_size=2,
            max_num_seqs=2,
            enable_chunked_prefill=False,
            enable_prefix_caching=True,
            aic_nextn=2,
            aic_nextn_accept_rates="1,1",
            kv_bytes_per_token=50_000,
            num_g2_blocks=1,
            offload_batch_size=1,
            bandwidth_g1_to_g2_gbps=0.5,
            bandwidth_g2_to_g1_gbps=0.5,
        )
    )
    core.receive(request("r0", [0, 1, 0, 0], 3))
    core.receive(request("r1", [0, 0, 0, 0], 1))
    first = core.execute_pass(0.0)
    assert [a.request_id for a in first.admissions] == ["r0", "r1"]
    assert first.output_signals == []
    assert core.state.requests["r0"].offload_wait is not None
    assert core.state.requests["r1"].status is RequestStatus.PREEMPTED
    second = core.execute_pass(first.end_ms)
    assert second.admissions == [], "r1 may not take the blocks r0 waited for"
    assert [s.request_id for s in second.output_signals] == ["r0"] * 3
    passes = [first, second]
    now = second.end_ms
    while not core.is_empty():
        passes.append(core.execute_pass(now))
        now = max(passes[-1].end_ms, now)
        assert len(passes) < 20, "the workload must drain"
    assert core.state.preemptions_total == 1


def test_a_request_that_waits_on_an_offload_reports_its_cached_prefix() -> None:
    """Issue 11's G2 defect: an admission that waits on a copy-out keeps its prefix hit.

    bs 4, 5 G1 blocks, caching on, G2 at 1 ms per block.
    1. Q (8 tokens, 1 output) then A (prompt P, 8 tokens, 1 output) run to completion:
       Q's two blocks, then P's two, are inactive; one block is free.
    2. C (P + 8 new tokens, 1 output) arrives. Admitting it revives P and needs two fresh
       blocks: the free one and Q's leaf, whose eviction starts a G1->G2 copy.
    3. Passes until C emits.

    Expected: C waits for the copy (no token in the pass it was first tried), then runs and
    its first output reports the 8 cached tokens of P, as it would without a G2 tier; the
    pass that admits it counts them as prefix-cache hits (16 queried, 8 hit).
    """
    core = core_with(num_gpu_blocks=5, enable_prefix_caching=True)
    attach_g1_offload_engine(core)
    prefix = list(range(8))
    now = 0.0
    for request_id, tokens in (("q", list(range(100, 108))), ("a", prefix)):
        core.receive(request(request_id, tokens, 1))
        while not core.is_empty():
            now = max(now, core.execute_pass(now).end_ms)
    assert core.kv.num_inactive_blocks() == 4

    core.receive(request("c", [*prefix, *range(200, 208)], 1))
    first = core.execute_pass(now)
    assert signals_of(first, "c") == []
    waiting = core.state.requests["c"]
    assert waiting.status is RequestStatus.WAITING
    assert waiting.offload_wait is not None, "the admission waits on the copy-out"

    cached: list[int | None] = []
    admitting = None
    for _ in range(10):
        now = max(now, core.earliest_offload_deadline() or now)
        result = core.execute_pass(now)
        if result.admissions:
            admitting = result
        cached += [s.cached_tokens for s in signals_of(result, "c")]
        if core.is_empty():
            break
    assert cached == [8]
    assert admitting is not None
    assert (admitting.prefix_cache_queries, admitting.prefix_cache_hits) == (16, 8)
