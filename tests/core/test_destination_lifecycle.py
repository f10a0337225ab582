"""Twins of the seed module `destination_lifecycle` (docs/upstream/seed-tests.md).

A decode worker accepts a destination (pending FIFO, no KV), reserves its prompt blocks when
capacity allows (no Stored events), publishes them at activation, then admits the request as a
prebuilt prompt that only decodes. The live-loop test of the module
(`productive_zero_duration_live_pass_continues_without_external_wake`) is not ported here.

Every KV event stream (pass results and out-of-pass commands) goes to a reference indexer, one
per core, which must see a clean stream.
"""

from __future__ import annotations

import re
import uuid

import pytest

from engined.core.args import EngineArgs, EngineType, WorkerType
from engined.core.engine import Engine
from engined.core.errors import CoreError, UnsupportedError
from engined.core.state import RequestStatus
from engined.core.types import (
    APPLIED,
    NOOP,
    ActivateDestination,
    CancelDestination,
    DestinationAccepted,
    DestinationReserved,
    FinishReason,
    KvTransferTimingMode,
    ReleaseSource,
    Request,
    ReserveDestination,
    SourceHeld,
    SubmitHandoffPrefill,
    Submitted,
    TransferTiming,
)
from tests.core.factories import (
    Watched,
    active_blocks,
    command,
    destination_block_ids,
    destination_is_held,
    finished,
    make_args,
    request,
    source_is_held,
    submit,
    uid,
    view,
)
from tests.reference_indexer import stored_hashes


def args(worker_type: WorkerType) -> EngineArgs:
    """bs 4, 12 blocks, budget 16, one sequence, chunked, prefix caching on."""
    return make_args(
        num_gpu_blocks=12,
        max_num_batched_tokens=16,
        max_num_seqs=1,
        enable_prefix_caching=True,
        worker_type=worker_type,
    )


def assert_no_republished_stores(activation: list[int], later: list[int]) -> None:
    assert all(h not in activation for h in later)


def drive_source_to_hold(source: Watched, handoff_id: str, req: Request) -> None:
    """Submit a handoff prefill and run passes (at most 8) until it is held."""
    core = source.core
    result = source.command(SubmitHandoffPrefill(handoff_id, req))
    assert isinstance(result, Submitted)
    now_ms = 0.0
    for _ in range(8):
        now_ms = source.execute(now_ms).end_ms
        if core.is_empty():
            break
    assert core.is_empty()
    assert source_is_held(core, handoff_id)
    assert not core.is_drained()


def test_destination_lifecycle_is_counted_once_as_queued_decode() -> None:
    """Pending, reserved and activated destinations each count once as a queued decode.

    Decode core: bs 4, 6 blocks, budget 32, one sequence, caching on.
    1. ReserveDestination(32001, request 32002: [1]*4, 1 output): reserved at once.
    2. Pass at 0 ms.
    3. ReserveDestination(32003, request 32004: [2]*24, 1 output): 6 blocks, only 5 free, so
       it stays pending.
    4. Pass at 0 ms.
    5. CancelDestination(32003).
    6. receive(request 32005: [3]*4, 2 outputs); pass at 1 ms (it runs).
    7. ActivateDestination(32001).
    8. Pass (the activated request waits: the only slot is taken); then one more pass.

    Expected: step 1 gives one lifecycle event and waiting 1; step 2's FPM has 1 queued decode,
    sum 4, variance 0. Step 3 gives no event and waiting 2; step 4's FPM has 2 queued decodes,
    sum 28, variance 100. Step 5 is Applied, waiting 1. Step 6: running 1. Step 7 is Applied
    and waiting stays 1. Step 8's first FPM: 0 queued prefills, 1 queued decode, sum 4; the
    second: 0 queued decodes, sum 0, waiting 0. The KV event stream is clean.
    """
    watched = Watched(
        Engine(
            make_args(
                num_gpu_blocks=6,
                max_num_batched_tokens=32,
                max_num_seqs=1,
                enable_prefix_caching=True,
                worker_type=WorkerType.DECODE,
            )
        )
    )
    core = watched.core
    held_handoff = uid(32_001)
    held = watched.apply(
        ReserveDestination(held_handoff, request(uid(32_002), [1] * 4, 1)),
    )
    assert len(held.lifecycle_events) == 1
    assert core.metrics().waiting == 1
    held_snapshot = watched.execute(0.0).fpm
    assert held_snapshot.num_queued_decode == 1
    assert held_snapshot.sum_queued_decode_kv_tokens == 4
    assert held_snapshot.var_queued_decode_kv_tokens == 0.0

    pending_handoff = uid(32_003)
    pending = watched.apply(
        ReserveDestination(pending_handoff, request(uid(32_004), [2] * 24, 1)),
    )
    assert pending.lifecycle_events == []
    assert core.metrics().waiting == 2
    mixed_snapshot = watched.execute(0.0).fpm
    assert mixed_snapshot.num_queued_decode == 2
    assert mixed_snapshot.sum_queued_decode_kv_tokens == 28
    assert mixed_snapshot.var_queued_decode_kv_tokens == 100.0

    assert watched.command(CancelDestination(pending_handoff)) == APPLIED
    assert core.metrics().waiting == 1

    submit(core, request(uid(32_005), [3] * 4, 2))
    blocker = watched.execute(1.0)
    assert core.metrics().running == 1
    assert watched.command(ActivateDestination(held_handoff)) == APPLIED
    assert core.metrics().waiting == 1

    activated_pass = watched.execute(blocker.end_ms)
    activated = activated_pass.fpm
    assert activated.num_queued_prefill == 0
    assert activated.num_queued_decode == 1
    assert activated.sum_queued_decode_kv_tokens == 4

    completed = watched.execute(activated_pass.end_ms).fpm
    assert completed.num_queued_decode == 0
    assert completed.sum_queued_decode_kv_tokens == 0
    assert core.metrics().waiting == 0
    watched.assert_clean()


def test_destination_transfer_footprint_excludes_decode_headroom() -> None:
    """The transferable footprint covers the prompt only, whatever max_tokens is.

    For max_tokens 1, then 128:
    1. Fresh decode core (bs 4, 12 blocks, caching on).
    2. ReserveDestination(new handoff, new request: tokens 0..10, max_tokens outputs).

    Expected: the reservation completes at once with exactly one DestinationReserved whose
    transferable_prompt_tokens is 12 (3 blocks of 4: the 10-token prompt, partial last block
    included, no decode headroom) in both cases. The reservation publishes no KV event, and
    the stream is clean.
    """

    def footprint(max_tokens: int) -> int:
        watched = Watched(Engine(args(WorkerType.DECODE)))
        effects = watched.apply(
            ReserveDestination(
                str(uuid.uuid4()), request(str(uuid.uuid4()), range(10), max_tokens)
            ),
            True,
        )
        assert len(effects.lifecycle_events) == 1, (
            "destination reservation should complete immediately"
        )
        (reserved,) = effects.lifecycle_events
        assert isinstance(reserved, DestinationReserved)
        assert watched.drain() == []
        watched.assert_clean()
        return reserved.transferable_prompt_tokens

    assert footprint(1) == 12
    assert footprint(128) == 12


def test_handoff_prefill_to_reserved_decode_owns_kv_until_normal_admission() -> None:
    """Full prefill -> reserved decode -> activation -> admission -> completion on two cores.

    Source: prefill core, worker 31; destination: decode core, worker 32 (bs 4, 12 blocks,
    budget 16, one sequence, caching on). Logical request 10001 (tokens 0..8, 2 outputs),
    handoff 10002.
    1. Destination runs request 10003 (tokens 0..4, 1 output) to completion: block 0..4 cached.
    2. Destination starts blocker 10004 (100..104, 3 outputs) at 1 ms: it holds the only slot.
    3. Source runs SubmitHandoffPrefill(10002, 10001) to its hold.
    4. Destination: ReserveDestination(10002, 10001), admission allowed.
    5. Destination runs passes until the blocker completes (at most 16); the pending
       destination is retried at the end of that pass, inside the engine.
    7. Destination starts activation blocker 10005 (200..204, 3 outputs).
    8. ActivateDestination(10002) on the destination.
    9. ReleaseSource(10002) on the source.
    10. Destination passes: blocked, blocker terminal, admitted, terminal.

    Expected: step 4 is DestinationAccepted(10001) with no lifecycle event (the slot is
    taken), the destination is held but takes no blocks and publishes no Stored. The pass
    that completes the blocker reserves it: one DestinationReserved(10002, 10001, 4) (block 0
    is cached), more active blocks than the blocker left (none), non-empty reserved block
    ids, no Stored. Step 8 is Applied: no longer held, same occupancy,
    request Waiting, the slot still taken, its block ids are the reserved ones, and Stored
    events are published now. Step 9 is Applied and drains the source. In step 10 the
    request stays Waiting on the reserved blocks until the activation blocker completes,
    then runs on blocks starting with the reserved ones (allocated >= prompt) without
    re-publishing the activation's blocks, and completes: destination empty, drained, 0
    active blocks. Both KV event streams are clean.
    """
    logical_id = uid(10_001)
    handoff_id = uid(10_002)
    logical_tokens = list(range(8))

    source = Watched(Engine(args(WorkerType.PREFILL), worker_id=31))
    dest = Watched(Engine(args(WorkerType.DECODE), worker_id=32))
    destination = dest.core

    submit(destination, request(uid(10_003), range(4), 1))
    dest.execute(0.0)
    assert destination.is_empty()
    dest.drain()

    blocker_id = uid(10_004)
    submit(destination, request(blocker_id, range(100, 104), 3))
    blocker_first = dest.execute(1.0)
    assert len(destination.queues().running) == 1
    dest.drain()

    drive_source_to_hold(source, handoff_id, request(logical_id, logical_tokens, 2))

    usage_before_reservation = active_blocks(destination)
    reserve = dest.apply(
        ReserveDestination(handoff_id, request(logical_id, logical_tokens, 2)),
    )
    assert reserve.result == DestinationAccepted(logical_id)
    assert reserve.lifecycle_events == []
    assert destination_is_held(destination, handoff_id)
    assert not destination.is_drained()
    assert len(destination.queues().running) == 1
    assert active_blocks(destination) == usage_before_reservation
    assert stored_hashes(dest.drain()) == []

    now_ms = blocker_first.end_ms
    blocker_completed = False
    for _ in range(16):
        result = dest.execute(now_ms)
        now_ms = result.end_ms
        if finished(result, blocker_id):
            blocker_completed = True
            break
        assert result.lifecycle_events == []
    assert blocker_completed, "blocker request should complete"
    usage_before_physical_reservation = 0  # the completed blocker holds no block
    reserved = result.lifecycle_events
    assert reserved == [DestinationReserved(handoff_id, logical_id, 4)]
    assert active_blocks(destination) > usage_before_physical_reservation
    reserved_block_ids = destination_block_ids(destination, handoff_id)
    assert reserved_block_ids
    assert stored_hashes(result.kv_events) == []

    activation_blocker_id = uid(10_005)
    submit(destination, request(activation_blocker_id, range(200, 204), 3))
    activation_blocker_first = dest.execute(now_ms)
    assert len(destination.queues().running) == 1
    occupancy_before_activation = active_blocks(destination)
    assert dest.command(ActivateDestination(handoff_id)) == APPLIED
    assert not destination_is_held(destination, handoff_id)
    assert active_blocks(destination) == occupancy_before_activation
    assert view(destination, logical_id).status is RequestStatus.WAITING
    assert len(destination.queues().running) == 1
    assert view(destination, logical_id).block_ids == reserved_block_ids
    activation_stores = stored_hashes(dest.drain())
    assert activation_stores

    assert source.command(ReleaseSource(handoff_id)) == APPLIED
    assert source.core.is_empty()
    assert source.core.is_drained()

    blocked = dest.execute(activation_blocker_first.end_ms)
    assert view(destination, logical_id).status is RequestStatus.WAITING
    assert view(destination, logical_id).block_ids == reserved_block_ids
    assert_no_republished_stores(activation_stores, stored_hashes(blocked.kv_events))

    blocker_terminal = dest.execute(blocked.end_ms)
    assert finished(blocker_terminal, activation_blocker_id)
    assert view(destination, logical_id).status is RequestStatus.WAITING

    admitted = dest.execute(blocker_terminal.end_ms)
    assert view(destination, logical_id).status is RequestStatus.RUNNING
    block_ids = view(destination, logical_id).block_ids
    assert block_ids[: len(reserved_block_ids)] == reserved_block_ids
    seen = view(destination, logical_id)
    assert seen.num_allocated_tokens >= seen.prompt_tokens
    assert_no_republished_stores(activation_stores, stored_hashes(admitted.kv_events))

    terminal = dest.execute(admitted.end_ms)
    assert finished(terminal, logical_id)
    assert destination.is_empty()
    assert destination.is_drained()
    assert not destination_is_held(destination, handoff_id)
    assert active_blocks(destination) == 0
    source.assert_clean()
    dest.assert_clean()
    assert source.indexer.ok_count("stored") > 0
    assert dest.indexer.ok_count("stored") > 0


def test_destination_cancel_reaches_activated_request_exactly_once() -> None:
    """CancelDestination reaches an activated, running destination exactly once.

    1. Decode core (worker 33): ReserveDestination(10102, request 10101: 0..8, 4 outputs).
    2. ActivateDestination(10102); one pass at 0 ms.
    3. CancelDestination(10102) twice.

    Expected: step 1 reserves at once (one DestinationReserved); step 2 is Applied and the
    request is still there after the pass. The first cancel is Applied and leaves the core
    empty, drained, with 0 active blocks; the second is a Noop. The KV stream is clean.
    """
    request_id = uid(10_101)
    handoff_id = uid(10_102)
    watched = Watched(Engine(args(WorkerType.DECODE), worker_id=33))
    core = watched.core

    reserve = watched.apply(
        ReserveDestination(handoff_id, request(request_id, range(8), 4)),
    )
    assert len(reserve.lifecycle_events) == 1
    assert isinstance(reserve.lifecycle_events[0], DestinationReserved)
    assert watched.command(ActivateDestination(handoff_id)) == APPLIED
    watched.execute(0.0)
    assert core.inspect(request_id) is not None

    assert watched.command(CancelDestination(handoff_id)) == APPLIED
    assert core.is_empty()
    assert core.is_drained()
    assert active_blocks(core) == 0
    assert watched.command(CancelDestination(handoff_id)) == NOOP
    watched.assert_clean()


def test_cancel_running_destination_immediately_retries_pending_head() -> None:
    """Cancelling a running destination frees its slot and reserves the pending head at once.

    1. Decode core: ReserveDestination(10201, request 10203: 0..4, 8 outputs): reserved.
    2. ActivateDestination(10201); pass at 0 ms: it runs (running 1).
    3. ReserveDestination(10202, request 10204: 100..104, 2 outputs): pending (slot taken).
    4. CancelDestination(10201) with admission allowed.
    5. CancelDestination(10202).

    Expected: step 1 yields one lifecycle event, step 2 is Applied, step 3 yields none.
    Step 4's effects hold exactly one DestinationReserved(10202, 10204); step 5 is Applied.
    The KV stream is clean.
    """
    watched = Watched(Engine(args(WorkerType.DECODE)))
    core = watched.core
    running_handoff = uid(10_201)
    pending_handoff = uid(10_202)
    running_request = uid(10_203)
    pending_request = uid(10_204)

    reserved = watched.apply(
        ReserveDestination(running_handoff, request(running_request, range(4), 8)),
    )
    assert len(reserved.lifecycle_events) == 1
    assert watched.command(ActivateDestination(running_handoff)) == APPLIED
    watched.execute(0.0)
    assert core.metrics().running == 1

    pending = watched.apply(
        ReserveDestination(pending_handoff, request(pending_request, range(100, 104), 2)),
    )
    assert pending.lifecycle_events == []

    canceled = watched.apply(CancelDestination(running_handoff))
    assert len(canceled.lifecycle_events) == 1
    (event,) = canceled.lifecycle_events
    assert isinstance(event, DestinationReserved)
    assert event.handoff_id == pending_handoff
    assert event.request_id == pending_request
    assert watched.command(CancelDestination(pending_handoff)) == APPLIED
    watched.assert_clean()


def test_trtllm_destination_reservation_fails_without_acquiring_kv() -> None:
    """TRT-LLM refuses destination reservations and takes no KV.

    1. Decode core with engine_type trtllm (bs 4, 12 blocks, budget 16, one sequence).
    2. ReserveDestination(10005, request 10006: 0..8, 2 outputs).

    Expected: it fails with exactly "destination reservation is not supported for TRT-LLM";
    the handoff is not held, 0 blocks are active, the core is drained, and the metrics are
    unchanged. The KV stream is clean.
    """
    watched = Watched(
        Engine(
            make_args(
                engine_type=EngineType.TRTLLM,
                num_gpu_blocks=12,
                max_num_batched_tokens=16,
                max_num_seqs=1,
                enable_prefix_caching=True,
                worker_type=WorkerType.DECODE,
            )
        )
    )
    destination = watched.core
    handoff_id = uid(10_005)
    metrics_before = destination.metrics()

    with pytest.raises(
        CoreError, match=re.escape("destination reservation is not supported for TRT-LLM")
    ) as error:
        watched.command(ReserveDestination(handoff_id, request(uid(10_006), range(8), 2)))
    assert isinstance(error.value, UnsupportedError)
    assert str(error.value) == "destination reservation is not supported for TRT-LLM"

    assert not destination_is_held(destination, handoff_id)
    assert active_blocks(destination) == 0
    assert destination.is_drained()
    assert destination.metrics() == metrics_before
    watched.assert_clean()


@pytest.mark.parametrize(
    ("mode", "transfer_ms"),
    [(KvTransferTimingMode.FULL_PROMPT, 12.0), (KvTransferTimingMode.DESTINATION_MISSING, 4.0)],
)
def test_kv_transfer_timing_mode_decides_what_the_handoff_moves(
    mode: KvTransferTimingMode, transfer_ms: float
) -> None:
    """`kv_transfer_timing_mode` as upstream's coordinator applies it (HandoffTransferTiming).

    Prefill engine: 1e6 bytes per token at 1 GB/s (1 ms per token), the given mode. Decode
    engine with tokens 0..8 cached (two blocks of 4).
    1. The prefill engine runs handoff 501's source (tokens 0..12, 1 output) to its hold.
    2. The decode engine reserves the destination of the same prompt.

    Expected: the source's last output carries the full prompt's delay (12 ms) whatever the
    mode, as upstream's `compute_prefill_handoff_delay_ms`; its `SourceHeld` carries the
    mode, 12 prompt tokens, the byte rate and the bandwidth. The destination lacks one block
    (4 tokens: the hit stops short of the last prompt token). The transfer the coordinator
    models moves the full prompt (12 ms) under `full_prompt` and the missing 4 tokens (4 ms)
    under `destination_missing`.
    """
    prefill = Engine(
        make_args(
            worker_type=WorkerType.PREFILL,
            enable_prefix_caching=True,
            num_gpu_blocks=12,
            max_num_batched_tokens=16,
            kv_bytes_per_token=1_000_000,
            kv_transfer_bandwidth=1.0,
            kv_transfer_timing_mode=mode,
        )
    )
    handoff_id, prompt = uid(501), list(range(12))
    assert isinstance(
        command(prefill, SubmitHandoffPrefill(handoff_id, request(uid(502), prompt, 1))),
        Submitted,
    )
    result = prefill.execute_pass(0.0)
    (last,) = result.request_outputs()
    assert last.finish_reason is FinishReason.LENGTH
    assert last.handoff_delay_ms == 12.0
    (held,) = result.lifecycle_events
    assert isinstance(held, SourceHeld)
    assert held.transfer_timing == TransferTiming(mode, 12, 1_000_000, 1.0)

    decode = Engine(args(WorkerType.DECODE))
    submit(decode, request(uid(503), range(8), 1))
    while not decode.is_empty():
        decode.execute_pass(0.0)
    effects = decode.apply(ReserveDestination(handoff_id, request(uid(502), prompt, 4)), now_ms=0)
    (reserved,) = effects.lifecycle_events
    assert isinstance(reserved, DestinationReserved)
    assert reserved.transferable_prompt_tokens == 4
    assert held.transfer_delay_ms(reserved) == transfer_ms
    assert held.transfer_timing.delay_ms(reserved.transferable_prompt_tokens) == transfer_ms


def test_kv_transfer_timing_is_unmodelled_without_a_byte_rate_or_bandwidth() -> None:
    for timing in (
        TransferTiming(KvTransferTimingMode.DESTINATION_MISSING, 12, None, 1.0),
        TransferTiming(KvTransferTimingMode.DESTINATION_MISSING, 12, 1_000_000, None),
        TransferTiming(KvTransferTimingMode.FULL_PROMPT, 12, 1_000_000, 0.0),
    ):
        assert timing.delay_ms(4) is None
    assert EngineArgs.from_mapping(
        {"kv_transfer_timing_mode": "DESTINATION_MISSING"}
    ).kv_transfer_timing_mode is (KvTransferTimingMode.DESTINATION_MISSING)
