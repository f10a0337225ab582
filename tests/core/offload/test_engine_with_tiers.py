"""Twins of the seed's `offload` module (13 tests), with the seed's numbers.

docs/upstream/dynamo-mocker.md §6 describes the mechanics each test exercises. The seed builds its
offload engine on a tokio runtime and seeds G2/G3 through kvbm `BlockManager`s; here the engine is
pure (`TierEngine`) and `seed_g2`/`seed_g3` place the same metadata-free inactive blocks.
`core.parts.kv.use`/`deref` stand for the seed's `kv_manager.process(&MoveBlock)`. Test
names are the seed's: its "swap-in" is an onboard here (engined/core/offload/__init__.py).
"""

from __future__ import annotations

from typing import Any

import pytest

from engined.core.args import WorkerType
from engined.core.block_moves import Deref
from engined.core.engine import Engine
from engined.core.errors import CoreError
from engined.core.offload.config import OffloadConfig
from engined.core.offload.tier_engine import TierEngine
from engined.core.state import RequestStatus
from engined.core.types import (
    APPLIED,
    BlockRemoved,
    BlockStored,
    CancelDestination,
    CancelSource,
    DestinationAccepted,
    DestinationReserved,
    EndedRequest,
    FinishReason,
    Medium,
    Request,
    ReserveDestination,
    Submit,
    SubmitHandoffPrefill,
)
from tests.core.factories import (
    MOCKER_1_3_0,
    active_blocks,
    command,
    destination_block_ids,
    destination_is_held,
    finished,
    inactive_blocks,
    lineage_kv,
    make_args,
    output_of,
    request,
    submit,
    tokens_of,
    uid,
    view,
)

MB = 1_000_000


def finish_within(core: Engine, request_id: str, *, passes: int) -> float:
    """Run passes from 0 ms until `request_id` finishes (within `passes`); the clock after."""
    now_ms = 0.0
    for _ in range(passes):
        result = core.execute_pass(now_ms)
        now_ms = result.end_ms
        if finished(result, request_id):
            return now_ms
    raise AssertionError(f"{request_id} did not finish within {passes} passes")


# Four seed tests park a prompt exactly as long as the whole G1 pool (1 block for 4 tokens,
# 3 blocks for 12) with max_output_tokens 2. engined rejects a prompt at or beyond the pool's
# capacity when it must generate (README "Faithfulness": vLLM caps max_model_len at the pool;
# 1.3.0 would let it preempt itself forever), so those prompts ask for no output instead.
# Nothing the tests assert depends on the output length: they park, pin and admit.
FULL_POOL_MAX_TOKENS = 0


def core_with(*, tiers: TierEngine | None = None, **overrides: Any) -> Engine:
    """The seed's builder: bs 4, budget 64, chunked prefill, no time scaling; `tiers` are
    attached at construction, the public way (`attach` is for the seed's attach-after-setup)."""
    fields: dict[str, Any] = {
        "block_size": 4,
        "max_num_batched_tokens": 64,
        "max_num_seqs": 4,
        "enable_chunked_prefill": True,
        "speedup_ratio": 0.0,
    }
    fields.update(overrides)
    return Engine(make_args(**fields), tiers=tiers)


def engine_with(**config: Any) -> TierEngine:
    """`MockOffloadEngine::new(config)` then `engine.tick(0.0)`, as the seed's tests do."""
    engine = TierEngine(OffloadConfig(**config))
    engine.tick(0.0)
    return engine


def seed_g2_blocks(core: Engine, engine: TierEngine, request_id: str, start: int = 0) -> None:
    """Place the request's full blocks from `start` in G2, inactive and without metadata."""
    seen = view(core, request_id)
    for key, parent in zip(seen.block_keys[start:], seen.block_parent_keys[start:], strict=True):
        engine.seed_g2(key, parent)


def seed_g3_blocks(core: Engine, engine: TierEngine, request_id: str) -> None:
    seen = view(core, request_id)
    for key, parent in zip(seen.block_keys, seen.block_parent_keys, strict=True):
        engine.seed_g3(key, parent)


def insert_running_request(
    core: Engine, request_id: str, tokens: list[int] | range, max_output_tokens: int
) -> None:
    """A running request whose whole prompt is allocated and computed (caching off)."""
    parts = core.parts
    req = parts.intake.build(
        request(request_id, tokens, max_output_tokens), request_id, RequestStatus.RUNNING
    )
    seq = req.seq
    use = seq.prepare_allocation(len(seq))
    assert use is not None, "running test request must need initial KV"
    assert lineage_kv(core).use(use, 0.0)
    seq.num_allocated_tokens = len(seq)
    req.num_computed_tokens = len(seq)
    state = parts.state
    state.requests[request_id] = req
    state.transition_to_running(request_id)


def seed_inactive_g1_block(core: Engine) -> None:
    """One registered inactive G1 block: 4 tokens 10000..10003, allocated then freed."""
    parts = core.parts
    seq = parts.intake.build(
        request("cache-seed", range(10_000, 10_004), 1), "cache-seed", RequestStatus.WAITING
    ).seq
    use = seq.prepare_allocation(len(seq))
    assert use is not None and use.num_blocks == 1
    assert lineage_kv(core).use(use, 0.0)
    seq.num_allocated_tokens = len(seq)
    assert parts.kv.apply_all(seq.free_moves(), 0.0)
    assert inactive_blocks(core) == 1


def attach(core: Engine, engine: TierEngine) -> None:
    """The seed's `attach_*_offload_engine` after the setup: blocks published before carry
    no router metadata (white-box: an engine gets its tiers at construction otherwise)."""
    lineage_kv(core).attach_tiers(engine)


def attach_g1_offload_engine(core: Engine) -> None:
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
    attach(core, engine)


def test_decode_growth_waits_without_preempting() -> None:
    core = core_with(num_gpu_blocks=3, enable_prefix_caching=False, worker_type=WorkerType.DECODE)
    seed_inactive_g1_block(core)
    blocked, unrelated = uid(701), uid(702)
    insert_running_request(core, blocked, range(4), 8)
    insert_running_request(core, unrelated, range(100, 102), 8)
    attach_g1_offload_engine(core)

    blocked_pass = core.execute_pass(0.0)
    assert not tokens_of(blocked_pass, blocked), "the blocked decode token must not be emitted"
    assert tokens_of(blocked_pass, unrelated), "the unrelated running request should continue"
    state = view(core, blocked)
    assert state.output_tokens == 0
    assert state.num_allocated_tokens == 4
    assert state.num_computed_tokens == 4
    dependency = state.offload_wait
    assert dependency is not None, "decode growth must retain its exact offload dependency"
    deadline = dependency.deadline_ms
    assert deadline is not None, "active offload dependency must expose a virtual deadline"
    assert deadline == 1.0
    other = view(core, unrelated)
    assert other.status is RequestStatus.RUNNING
    assert other.num_preemptions == 0
    assert core.metrics().preemptions_total == 0

    core.advance_tiers(deadline)
    resumed = core.execute_pass(deadline)
    assert tokens_of(resumed, blocked), "decode must resume after its offload terminates"
    state = view(core, blocked)
    assert state.output_tokens == 1
    assert state.num_allocated_tokens == 5
    assert state.offload_wait is None
    assert core.metrics().preemptions_total == 0


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
    assert not blocked_pass.request_outputs(), "no burst may begin before the full reservation"
    for request_id in (blocked, unrelated):
        req = view(core, request_id)
        assert req.output_tokens == 0
        assert req.num_preemptions == 0
        assert req.status is RequestStatus.RUNNING
        assert req.offload_wait is not None
    dependency = view(core, blocked).offload_wait
    assert dependency is not None
    deadline = dependency.deadline_ms
    assert deadline is not None, "active offload dependency must expose a virtual deadline"
    assert core.metrics().preemptions_total == 0

    core.advance_tiers(deadline)
    resumed = core.execute_pass(deadline)
    assert len(tokens_of(resumed, blocked)) == 6
    assert len(tokens_of(resumed, unrelated)) == 6
    for request_id in (blocked, unrelated):
        req = view(core, request_id)
        assert req.output_tokens == 6
        assert req.num_preemptions == 0
        assert req.offload_wait is None
    assert core.metrics().preemptions_total == 0


def test_execute_pass_ticks_offload_engine_when_attached() -> None:
    core = core_with(
        num_gpu_blocks=8, enable_prefix_caching=False, tiers=TierEngine(OffloadConfig())
    )
    assert core.next_deadline() is None
    core.execute_pass(0.0)
    core.execute_pass(10.0)
    assert core.next_deadline() is None


def test_live_destination_eviction_uses_command_application_time() -> None:
    block_size = 4
    core = Engine(
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
    attach(core, engine)

    cached = uid(1)
    submit(core, request(cached, range(block_size), 1))
    now_ms = finish_within(core, cached, passes=4)
    assert active_blocks(core) == 0
    assert inactive_blocks(core) == 1

    blocker = uid(3)
    submit(core, request(blocker, [9] * (block_size - 1), 100))
    blocker_pass = core.execute_pass(now_ms)
    blocker_out = output_of(blocker_pass, blocker)
    assert blocker_out is not None and blocker_out.finish_reason is None
    assert active_blocks(core) == 1
    assert inactive_blocks(core) == 1

    handoff_id = uid(2)
    effects = core.apply(
        ReserveDestination(handoff_id, request(uid(2), range(block_size, 2 * block_size), 1)),
        now_ms=100.0,
    )
    assert effects.lifecycle_events == []

    deadline = core.next_deadline()
    assert deadline is not None, "reservation eviction should schedule G1 to G2 offload"
    assert abs(deadline - 120.0) < 0.01, (
        f"20 ms transfer applied at t=100 should finish near t=120, got {deadline}"
    )
    core.advance_tiers(100.0)
    assert active_blocks(core) == 2, "the blocker and the offload source both occupy G1"
    assert core.next_deadline() == deadline

    # The copy lands at its deadline, freeing the source slot; the engine's retry that follows
    # reserves the destination in the same call.
    advanced = core.advance_tiers(deadline)
    assert any(isinstance(e, BlockStored) and e.medium is Medium.CPU for e in advanced.kv_events)
    reserved = advanced.lifecycle_events
    assert any(
        isinstance(e, DestinationReserved) and e.handoff_id == handoff_id and e.request_id == uid(2)
        for e in reserved
    )
    assert destination_block_ids(core, handoff_id) != []
    assert active_blocks(core) == 1 + len(destination_block_ids(core, handoff_id)), (
        "the blocker alone, plus the reservation"
    )


def test_ready_swap_ins_drain_on_pass_entry() -> None:
    core = core_with(num_gpu_blocks=8, enable_prefix_caching=True)
    engine = engine_with(block_size_tokens=4, block_size_bytes=MB, bandwidth_g2_to_g1_gbps=1.0)
    submit(core, request("hit", range(4), 2))
    assert len(view(core, "hit").block_keys) == 1, "one full block"
    seed_g2_blocks(core, engine, "hit")
    attach(core, engine)

    first = core.execute_pass(0.0)
    assert first.admissions == [], "parked onboard should not admit in the same pass"
    assert len(core.queues().parked) == 1, "request must be parked on onboard"

    core.execute_pass(0.5)
    assert len(core.queues().parked) == 1, "pending onboard must survive"

    core.execute_pass(1.0)
    assert core.queues().parked == [], "completed onboard must drain on pass entry"


def test_g2_swap_in_reserves_destination_slot_before_transfer() -> None:
    core = core_with(num_gpu_blocks=1, max_num_seqs=2, enable_prefix_caching=True)
    engine = engine_with(block_size_tokens=4, block_size_bytes=MB, bandwidth_g2_to_g1_gbps=1.0)
    submit(core, request("hit", range(4), FULL_POOL_MAX_TOKENS))
    submit(core, request("cold", range(4, 8), FULL_POOL_MAX_TOKENS))
    assert len(view(core, "hit").block_keys) == 1
    seed_g2_blocks(core, engine, "hit")
    attach(core, engine)

    result = core.execute_pass(0.0)
    assert len(core.queues().parked) == 1, "G2 hit should be parked on onboard"
    assert active_blocks(core) == 1, "parked onboard must pin one destination G1 slot"
    assert result.admissions == [], "the cold request must not take the reserved slot"
    assert "cold" in core.queues().waiting, "cold request should remain waiting for G1 capacity"


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
    submit(core, request("hit", range(4), FULL_POOL_MAX_TOKENS))
    assert len(view(core, "hit").block_keys) == 1
    seed_g3_blocks(core, engine, "hit")
    attach(core, engine)

    parked = core.execute_pass(0.0)
    assert parked.admissions == []
    assert len(core.queues().parked) == 1

    core.advance_tiers(1.0)
    assert len(core.queues().parked) == 1, "G3->G2 completion starts the G2->G1 hop"

    core.advance_tiers(2.0)
    assert core.queues().parked == [], "G2->G1 completion requeues before admission"

    admitted = core.execute_pass(2.0)
    assert len(admitted.admissions) == 1
    assert admitted.admissions[0].reused_input_tokens == 4


def cache_prefix_in_g1(core: Engine, request_id: str, blocks: int) -> None:
    """The seed's manual `Use` of the first `blocks` blocks, then `Deref` of them: inactive."""
    seq = core.parts.state.requests[request_id].seq
    use = seq.prepare_allocation(blocks * core.block_size)
    assert use is not None and use.num_blocks == blocks
    assert lineage_kv(core).use(use, 0.0)
    lineage_kv(core).deref(Deref(None, list(use.keys)))


def test_partial_g2_swap_in_pins_cached_g1_prefix() -> None:
    core = core_with(num_gpu_blocks=3, enable_prefix_caching=True)
    engine = engine_with(block_size_tokens=4, block_size_bytes=MB, bandwidth_g2_to_g1_gbps=1.0)
    submit(core, request("partial", range(12), FULL_POOL_MAX_TOKENS))
    cache_prefix_in_g1(core, "partial", 2)
    assert len(view(core, "partial").block_keys) == 3
    seed_g2_blocks(core, engine, "partial", start=2)
    attach(core, engine)

    result = core.execute_pass(0.0)
    assert result.admissions == []
    assert len(core.queues().parked) == 1
    assert active_blocks(core) == 3, "two pinned prefix blocks plus one destination slot"


def test_cancel_parked_swap_in_releases_ownership_and_isolates_uuid_reuse() -> None:
    block_size = 4
    core = core_with(num_gpu_blocks=3, enable_prefix_caching=True)
    engine = engine_with(
        block_size_tokens=block_size, block_size_bytes=MB, bandwidth_g2_to_g1_gbps=1.0
    )
    parked_id, source_handoff = uid(1), uid(10)
    submitted = command(
        core,
        SubmitHandoffPrefill(
            source_handoff, request(parked_id, range(3 * block_size), FULL_POOL_MAX_TOKENS)
        ),
    )
    assert submitted.request_id == parked_id  # type: ignore[union-attr]
    cache_prefix_in_g1(core, parked_id, 2)
    seed_g2_blocks(core, engine, parked_id, start=2)
    attach(core, engine)

    core.execute_pass(0.0)
    assert len(core.queues().parked) == 1
    assert active_blocks(core) == 3
    with pytest.raises(CoreError):
        command(core, Submit(request(parked_id, [9] * block_size, 1)))

    follower_handoff = uid(20)
    reserve = core.apply(
        ReserveDestination(follower_handoff, request(uid(2), [7] * block_size, 1)), now_ms=0.0
    )
    assert reserve.lifecycle_events == []

    canceled = core.apply(CancelSource(source_handoff), now_ms=0.0)
    assert canceled.result == APPLIED
    assert core.queues().parked == []
    assert core.inspect(parked_id) is None
    assert canceled.ended == [EndedRequest(parked_id, FinishReason.CANCELLED)]
    assert canceled.lifecycle_events == [], (
        "a cancelled onboard keeps its prefix pins and destination until the transfer ends"
    )

    assert command(core, CancelDestination(follower_handoff)) == APPLIED
    assert active_blocks(core) == 3, "pins and destination of the cancelled onboard stay"
    core.advance_tiers(0.5)
    assert active_blocks(core) == 3

    assert submit(core, request(parked_id, [99] * block_size, 1)) == parked_id
    core.advance_tiers(10.0)
    assert active_blocks(core) == 0
    assert core.queues().parked == []
    assert core.inspect(parked_id) is not None
    replacement = core.execute_pass(10.0)
    assert any(a.request_id == parked_id for a in replacement.admissions)


def test_completed_onboards_reenter_front_preserving_order() -> None:
    core = core_with(num_gpu_blocks=2, max_num_seqs=2, enable_prefix_caching=True)
    engine = engine_with(block_size_tokens=4, block_size_bytes=MB, bandwidth_g2_to_g1_gbps=2.0)
    first_hit, second_hit, cold = uid(1), uid(2), uid(3)
    submit(core, request(first_hit, range(4), 2))
    submit(core, request(second_hit, range(4, 8), 2))
    submit(core, request(cold, range(8, 12), 2))
    for request_id in (first_hit, second_hit):
        assert len(view(core, request_id).block_keys) == 1
        seed_g2_blocks(core, engine, request_id)
    attach(core, engine)

    first = core.execute_pass(0.0)
    assert first.admissions == [], "both G2 hits park; the cold request has no free G1 slot"
    assert len(core.queues().parked) == 2
    assert list(core.queues().waiting) == [cold], "only the cold request should remain waiting"

    # Both 1 MB transfers share a 2 GB/s link: 1 GB/s each, both finish at 1 ms.
    second = core.execute_pass(1.0)
    assert [a.request_id for a in second.admissions] == [first_hit, second_hit], (
        "completed onboards re-enter ahead of cold requests, in park order"
    )


def test_cold_request_with_g2_prefix_swaps_in_then_admits() -> None:
    block_size = 4
    # The whole aligned prompt is reused: 1.3.0's rule (vLLM's would report 12).
    core = core_with(num_gpu_blocks=16, enable_prefix_caching=True, prefix_hit_rule=MOCKER_1_3_0)
    # 250 KB per block x 4 blocks at 1 GB/s = a 1.0 ms onboard.
    engine = engine_with(
        block_size_tokens=block_size, block_size_bytes=250_000, bandwidth_g2_to_g1_gbps=1.0
    )
    submit(core, request("cold", range(4 * block_size), 2))
    assert view(core, "cold").block_keys, "test sequence must have full blocks"
    seed_g2_blocks(core, engine, "cold")
    attach(core, engine)

    first = core.execute_pass(0.0)
    assert len(core.queues().parked) == 1, "request must be parked on onboard"
    assert first.admissions == [], "no admission should fire while parked"

    core.execute_pass(0.5)
    assert len(core.queues().parked) == 1

    third = core.execute_pass(2.0)
    assert core.queues().parked == [], "onboard must drain"
    assert len(third.admissions) == 1, "promoted request must be admitted in the same pass"
    admission = third.admissions[0]
    assert admission.request_id == "cold"
    assert admission.reused_input_tokens > 0, "onboarded prefix counts as reused tokens"
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
    # 4 onboards x 4 blocks x 250 KB on a 4 GB/s link: 1 GB/s each, all done at 1.0 ms.
    engine = engine_with(
        block_size_tokens=block_size, block_size_bytes=250_000, bandwidth_g2_to_g1_gbps=4.0
    )
    shared = list(range(tokens_per_request))
    ids = [uid(1000 + i) for i in range(4)] + [uid(2000)]
    for request_id in ids[:4]:
        submit(core, request(request_id, shared, 2))
    submit(core, request(ids[4], range(tokens_per_request, 2 * tokens_per_request), 2))
    seed_g2_blocks(core, engine, ids[0])
    attach(core, engine)

    admissions: list[tuple[int, int]] = []
    stored = removed = onboard_admissions = 0
    for ts in (0.0, 0.5, 0.8, 1.5, 3.0):
        parked_before = len(core.queues().parked)
        result = core.execute_pass(ts)
        onboard_admissions += max(parked_before - len(core.queues().parked), 0)
        admissions.extend(
            (ids.index(a.request_id), a.reused_input_tokens) for a in result.admissions
        )
        stored += sum(isinstance(e, BlockStored) for e in result.kv_events)
        removed += sum(isinstance(e, BlockRemoved) for e in result.kv_events)
    return admissions, stored, removed, onboard_admissions


def test_equivalence_replayed_twice_with_g2_offload() -> None:
    first = run_g2_trace()
    second = run_g2_trace()
    assert first[3] > 0, "the trace must exercise at least one G2 onboard admission"
    assert first == second, f"replayed G2-offload trace must be deterministic: {first} {second}"


def test_destination_reservation_retries_after_presence_filtered_offload() -> None:
    block_size = 4
    core = core_with(num_gpu_blocks=2, max_num_seqs=2, enable_prefix_caching=True)
    cached = uid(1)
    submit(core, request(cached, range(block_size), 1))
    cached_seen = view(core, cached)
    cached_keys = list(zip(cached_seen.block_keys, cached_seen.block_parent_keys, strict=True))
    now_ms = finish_within(core, cached, passes=4)
    assert active_blocks(core) == 0
    assert inactive_blocks(core) == 1

    engine = TierEngine(OffloadConfig(block_size_tokens=block_size))
    engine.tick(now_ms)
    for key, parent in cached_keys:
        engine.seed_g2(key, parent)
    attach(core, engine)

    handoff_id = request_id = uid(2)
    effects = core.apply(
        ReserveDestination(
            handoff_id,
            Request(
                token_ids=list(range(block_size, 3 * block_size)),
                max_tokens=1,
                request_id=request_id,
            ),
        ),
        now_ms=now_ms,
    )
    assert effects.result == DestinationAccepted(request_id)
    assert core.next_deadline() is None
    assert any(
        isinstance(e, DestinationReserved)
        and e.handoff_id == handoff_id
        and e.request_id == request_id
        for e in effects.lifecycle_events
    )
    assert destination_is_held(core, handoff_id)
    assert len(destination_block_ids(core, handoff_id)) == 2


# --- beyond the seed ------------------------------------------------------------------------


def test_offloaded_block_is_published_per_tier_with_its_gpu_identity() -> None:
    """Evicted from G1: GPU Removed, then (at the copy's deadline) CPU Stored with the same
    hash, parent, local hash and tokens the GPU Stored had."""
    core = Engine(
        make_args(
            num_gpu_blocks=2,
            max_num_seqs=1,
            enable_prefix_caching=True,
            num_g2_blocks=4,
            kv_bytes_per_token=250_000,
            bandwidth_g1_to_g2_gbps=1.0,
        )
    )
    assert core.metrics().g2_total_blocks == 4, "num_g2_blocks and kv_bytes_per_token attach them"
    submit(core, request("first", range(8), 0))
    gpu_stored = [e for e in core.execute_pass(0.0).kv_events if isinstance(e, BlockStored)]
    assert [len(e.block_hashes) for e in gpu_stored] == [2]
    (stored,) = gpu_stored
    submit(core, request("second", range(100, 104), 0))
    evicting = core.execute_pass(1.0)
    removed = [e for e in evicting.kv_events if isinstance(e, BlockRemoved)]
    assert [(e.medium, e.block_hashes) for e in removed] == [(Medium.GPU, [stored.block_hashes[1]])]
    assert evicting.admissions == [], "the admission waits for the evicted block's copy"
    deadline = core.next_deadline()
    assert deadline == 2.0, "1 MB at 1 GB/s, started at the pass's time"
    landed = core.advance_tiers(deadline).kv_events
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
    core = Engine(
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
    submit(core, request("r0", [0, 1, 0, 0], 3))
    submit(core, request("r1", [0, 0, 0, 0], 1))
    first = core.execute_pass(0.0)
    assert [a.request_id for a in first.admissions] == ["r0", "r1"]
    assert first.request_outputs() == []
    assert view(core, "r0").offload_wait is not None
    assert view(core, "r1").status is RequestStatus.PREEMPTED
    second = core.execute_pass(first.end_ms)
    assert second.admissions == [], "r1 may not take the blocks r0 waited for"
    assert [(o.request_id, len(o.new_token_ids)) for o in second.request_outputs()] == [("r0", 3)]
    passes = [first, second]
    now = second.end_ms
    while not core.is_empty():
        passes.append(core.execute_pass(now))
        now = max(passes[-1].end_ms, now)
        assert len(passes) < 20, "the workload must drain"
    assert core.metrics().preemptions_total == 1


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
        submit(core, request(request_id, tokens, 1))
        while not core.is_empty():
            now = max(now, core.execute_pass(now).end_ms)
    assert inactive_blocks(core) == 4

    submit(core, request("c", [*prefix, *range(200, 208)], 1))
    first = core.execute_pass(now)
    assert output_of(first, "c") is None
    waiting = view(core, "c")
    assert waiting.status is RequestStatus.WAITING
    assert waiting.offload_wait is not None, "the admission waits on the copy-out"

    cached: list[int | None] = []
    admitting = None
    for _ in range(10):
        now = max(now, core.next_deadline() or now)
        result = core.execute_pass(now)
        if result.admissions:
            admitting = result
        out = output_of(result, "c")
        if out is not None:
            cached.append(out.cached_tokens)
        if core.is_empty():
            break
    assert cached == [8]
    assert admitting is not None
    assert (admitting.prefix_cache_queries, admitting.prefix_cache_hits) == (16, 8)
