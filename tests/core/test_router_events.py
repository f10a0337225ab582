"""Twins of the seed's `router_events` module (docs/upstream/seed-tests.md, `mod router_events`).

The Rust tests feed every pass's KV events to `RouterIndexerHarness` (a real router indexer);
here `ReferenceIndexer` stands in for it (docs/upstream/dynamo-mocker.md §8). `harness.apply_events`
asserts no event errors after each batch, so `apply` below does the same with `assert_clean`, which
also covers the harness's no-warnings (duplicate store) check.

Upstream events carry the worker id (`new_with_kv_capture`); ours carry only `dp_rank` and the
daemon adds the worker identity, so the indexer is told the worker id and the events are checked
for `dp_rank == 0`.

Exact values beyond the seed's assertions are derived in the comments from
docs/upstream/dynamo-mocker.md (§2.2 `Use`/`Promote`, §2.1 lineage eviction, §2.3 when
events are emitted, §4.1-§4.5 the pass, admission and emission).
"""

from __future__ import annotations

from engined.core.args import PreemptionMode
from engined.core.engine import Engine
from engined.core.state import RequestStatus
from engined.core.types import BlockRemoved, BlockStored, KvEvent
from tests.core.factories import (
    MOCKER_1_3_0,
    ROUTER_TEST_WORKER_ID,
    active_blocks,
    emitted_tokens,
    make_args,
    make_core,
    request,
    router_args,
    submit,
    uid,
    view,
)
from tests.reference_indexer import ReferenceIndexer, removed_event_count, stored_hashes

BLOCK_SIZE = 4

# First Stored event for prompt 0..8, bs 4 (docs/upstream/dynamo-mocker.md §3.2):
# block (sequence) hashes and local (tokens) hashes of blocks [0..4) and [4..8).
PROMPT_0_8_BLOCK_HASHES = [9143094415614847814, 9510318385840434533]
PROMPT_0_8_LOCAL_HASHES = [9143094415614847814, 12124091508212882195]


def apply(indexer: ReferenceIndexer, events: list[KvEvent]) -> None:
    """`harness.apply_events(events)`: apply for worker 23, then no errors may be recorded."""
    assert all(event.dp_rank == 0 for event in events)
    indexer.apply(events, worker_id=ROUTER_TEST_WORKER_ID)
    indexer.assert_clean()


def test_vllm_pass_visibility_is_pass_start() -> None:
    """KV events of a pass are produced by that pass, for dp_rank 0.

    1. Core with prefix caching (router_args: bs 4, 12 blocks, budget 12, 3 seqs), worker 23.
    2. Submit request 71: prompt 0..8, max_tokens 2.
    3. Run one pass at t=0.

    Expected: the pass that admitted the request returns non-empty KV events, all for dp_rank 0.
    Upstream also asserts `router_event_visibility == PassStart`; our core always publishes at
    pass start and PassResult has no such field, so the non-empty events of the admitting pass
    are what is checked. Exactly one Stored (the two prompt blocks) comes out, with the hashes
    docs/upstream/dynamo-mocker.md §3.2 gives for prompt 0..8; the first token opens a partial
    block, which stores nothing (§2.3).
    """
    core = make_core(router_args(), worker_id=ROUTER_TEST_WORKER_ID)
    submit(core, request(uid(71), range(8), 2))

    result = core.execute_pass(0.0)

    assert [a.request_id for a in result.admissions] == [uid(71)]
    assert result.kv_events, "the admitting pass must carry its KV events (PassStart)"
    assert all(event.dp_rank == 0 for event in result.kv_events)

    # Exact event (docs/upstream/dynamo-mocker.md §3.2, and §2.2-§2.3: one run of fresh blocks).
    assert result.kv_events == [
        BlockStored(
            event_id=0,
            dp_rank=0,
            parent_hash=None,
            block_hashes=PROMPT_0_8_BLOCK_HASHES,
            local_hashes=PROMPT_0_8_LOCAL_HASHES,
            token_ids=list(range(8)),
            block_size=BLOCK_SIZE,
        )
    ]
    indexer = ReferenceIndexer(BLOCK_SIZE)
    apply(indexer, result.kv_events)
    assert indexer.ok_count("stored") == 1


def test_completion_events_apply_cleanly() -> None:
    """A request run to completion produces a stream a router applies without errors.

    1. Core with prefix caching (router_args), worker 23; indexer with bs 4.
    2. Submit request 41: prompt 0..8, max_tokens 4.
    3. Run passes back to back (now = previous end_ms) until the core is empty, applying every
       pass's KV events to the indexer.

    Expected: some pass stored blocks, the indexer counted stored events ok, no KV block is left
    active, and the indexer saw no error or warning.
    Exact (docs/upstream/dynamo-mocker.md §2.3, §4.4): 4 passes with one token each; the only event
    is the Stored of the two prompt blocks in pass 1. Token 1 opens a partial block (no event);
    token 4 brings the length to 12, completing that block without a Promote (promotion happens when
    token 13 opens the next block), and completion only Derefs, which publishes nothing.
    """
    indexer = ReferenceIndexer(BLOCK_SIZE)
    core = make_core(router_args(), worker_id=ROUTER_TEST_WORKER_ID)
    submit(core, request(uid(41), range(8), 4))

    now_ms = 0.0
    saw_store = False
    passes = 0
    outputs = 0
    all_events: list[KvEvent] = []
    while not core.is_empty():
        result = core.execute_pass(now_ms)
        saw_store |= bool(stored_hashes(result.kv_events))
        now_ms = result.end_ms
        apply(indexer, result.kv_events)
        all_events += result.kv_events
        passes += 1
        outputs += len(result.request_outputs())
        assert passes <= 100, "request did not complete"

    assert saw_store
    assert indexer.ok_count("stored") > 0
    assert active_blocks(core) == 0
    indexer.assert_clean()

    # Exact values (see docstring).
    assert passes == 4
    assert outputs == 4
    assert stored_hashes(all_events) == PROMPT_0_8_LOCAL_HASHES
    assert indexer.ok_count("stored") == 1
    assert removed_event_count(all_events) == 0


def test_preemption_recompute_events_apply_cleanly() -> None:
    """Preemption followed by recompute keeps the router's view consistent.

    1. Core: bs 4, 6 blocks, budget 16, 2 seqs, chunked, prefix caching on, LIFO; worker 23.
    2. Submit r1 = 51 (prompt 0..8) and r2 = 52 (prompt 100..108), max_tokens 8 each.
    3. Run up to 16 passes (now = max(end_ms, now + 1)), applying events, until r2 is Preempted.
    4. Then run up to 32 more passes until a pass admits r2 again.

    Expected: r2 gets preempted (status Preempted, 0 computed tokens, 1 preemption, head of the
    waiting queue), is later re-admitted for recompute, and the indexer saw no error or warning.
    Exact (docs/upstream/dynamo-mocker.md §2.4 `test_preemption_requeues_newest_running_request`,
    which is the same pool): both prompts fill 4 blocks in pass 1 and each first token opens a
    partial block (6 active). Passes 2-4 need no block. In pass 5 r1's token 13 promotes its third
    block (Stored, parent = r1's second block) and its next partial block finds no room, so LIFO
    preempts r2 (8 prompt + 4 generated = 12 tokens). r2 needs 3 blocks but only 2 are free
    while r1 holds 4, so it waits until r1 finishes (token 8 in the 3rd pass of step 4) and is
    admitted in the 4th pass, reusing its 2 inactive prompt blocks (8 tokens). In that same pass
    its first recomputed-and-emitted token promotes its third block (Stored) and opens a partial
    block, which evicts r1's tail block, the oldest inactive leaf (one Removed; §2.1).
    """
    indexer = ReferenceIndexer(BLOCK_SIZE)
    args = make_args(
        num_gpu_blocks=6,
        max_num_batched_tokens=16,
        max_num_seqs=2,
        enable_prefix_caching=True,
        preemption_mode=PreemptionMode.LIFO,
    )
    core = make_core(args, worker_id=ROUTER_TEST_WORKER_ID)
    r1 = uid(51)
    r2 = uid(52)
    for request_id, tokens in ((r1, range(8)), (r2, range(100, 108))):
        submit(core, request(request_id, tokens, 8))

    now_ms = 0.0
    saw_preemption = False
    preemption_pass = 0
    events: list[KvEvent] = []
    for n in range(1, 17):
        result = core.execute_pass(now_ms)
        now_ms = max(result.end_ms, now_ms + 1.0)
        apply(indexer, result.kv_events)
        events += result.kv_events
        seen = core.inspect(r2)
        if seen is not None and seen.status is RequestStatus.PREEMPTED:
            saw_preemption = True
            preemption_pass = n
            break

    assert saw_preemption
    req = view(core, r2)
    assert req.status is RequestStatus.PREEMPTED
    assert req.num_computed_tokens == 0
    assert req.num_preemptions == 1
    assert core.queues().waiting[0] == r2

    # Exact values up to the preemption (see docstring).
    assert preemption_pass == 5
    assert result.metrics.preemptions_total == 1
    assert req.num_tokens == 12
    assert req.output_tokens == 4
    assert core.queues().running == [r1]
    assert [type(e) for e in events] == [BlockStored, BlockStored, BlockStored]
    first, second, promoted = events
    assert isinstance(first, BlockStored)
    assert isinstance(second, BlockStored)
    assert isinstance(promoted, BlockStored)
    assert (first.parent_hash, first.block_hashes) == (None, PROMPT_0_8_BLOCK_HASHES)
    assert second.parent_hash is None
    assert len(second.block_hashes) == 2
    assert promoted.parent_hash == PROMPT_0_8_BLOCK_HASHES[1]
    assert len(promoted.block_hashes) == 1

    readmitted = False
    readmission_pass = 0
    reused_tokens = -1
    for n in range(1, 33):
        result = core.execute_pass(now_ms)
        now_ms = max(result.end_ms, now_ms + 1.0)
        for admission in result.admissions:
            if admission.request_id == r2:
                readmitted = True
                reused_tokens = admission.reused_input_tokens
        apply(indexer, result.kv_events)
        if readmitted:
            readmission_pass = n
            break

    assert readmitted, "preempted request should be admitted for recompute"
    indexer.assert_clean()

    # Exact values of the recompute (see docstring).
    assert readmission_pass == 4
    assert reused_tokens == 8
    assert core.inspect(r1) is None
    assert [type(e) for e in result.kv_events] == [BlockStored, BlockRemoved]
    assert indexer.ok_count("stored") == 4
    assert indexer.ok_count("removed") == 1


def test_mtp_preemption_recompute_drains_with_clean_events() -> None:
    """MTP decode with preemption and recompute drains with a clean event stream.

    1. Core: bs 4, 6 blocks, budget 12, 3 seqs, chunked, prefix caching on, LIFO,
       MTP nextn 2 with accept rates "0,1" (every burst is exactly one token); worker 23.
    2. Submit 61 (prompt 0..8), 62 (prompt 100..108), 63 (prompt 200..212), max_tokens 7 each.
    3. Run up to 200 passes (now = max(end_ms, now + 1)) until the core is empty, counting
       output signals and applying every pass's KV events.

    Expected: the core drains (empty, no waiting, no running, no active block), 21 tokens are
    output (3 x 7), at least one Removed event was seen, and the indexer saw no error or
    warning.
    Exact (traced pass by pass from docs/upstream/dynamo-mocker.md §4.1-§4.6 and §2.1-§2.3): 20
    passes. The MTP block reservation finds no room in passes 3, 4 and 5 (LIFO preempts 62, which is
    re-admitted in passes 4 and 5 with its 2 inactive prompt blocks) and in passes 9, 10 and 11
    (LIFO preempts 63 the same way): 6 preemptions. The stream has 16 events: 10 Stored (61's
    prompt, 62's prompt in two chunks, 61's promoted third block, 63's prompt, 63's third block
    stored again at its readmissions in passes 10, 11 and 14 after being evicted, 62's promoted
    third block, 63's promoted fourth block) and 6 Removed (61's 3 blocks in one event when 63
    is first admitted in pass 8, 63's third block three times, 62's tail blocks twice).
    """
    indexer = ReferenceIndexer(BLOCK_SIZE)
    args = make_args(
        num_gpu_blocks=6,
        max_num_batched_tokens=12,
        max_num_seqs=3,
        enable_prefix_caching=True,
        preemption_mode=PreemptionMode.LIFO,
        aic_nextn=2,
        aic_nextn_accept_rates="0,1",
        # The traced numbers are 1.3.0's: no recomputed (or MTP-dropped) prefix block.
        prefix_hit_rule=MOCKER_1_3_0,
    )
    core: Engine = make_core(args, worker_id=ROUTER_TEST_WORKER_ID)
    for request_id, tokens in (
        (uid(61), range(8)),
        (uid(62), range(100, 108)),
        (uid(63), range(200, 212)),
    ):
        submit(core, request(request_id, tokens, 7))

    now_ms = 0.0
    output_tokens = 0
    saw_remove = False
    passes = 0
    removed_events = 0
    num_events = 0
    preemptions_total = 0
    for _ in range(200):
        if core.is_empty():
            break
        result = core.execute_pass(now_ms)
        now_ms = max(result.end_ms, now_ms + 1.0)
        output_tokens += emitted_tokens(result)
        saw_remove |= removed_event_count(result.kv_events) > 0
        removed_events += removed_event_count(result.kv_events)
        num_events += len(result.kv_events)
        preemptions_total = result.metrics.preemptions_total
        passes += 1
        apply(indexer, result.kv_events)

    assert core.is_empty()
    assert output_tokens == 21
    assert not core.queues().waiting
    assert not core.queues().running
    assert active_blocks(core) == 0
    assert saw_remove
    indexer.assert_clean()

    # Exact values (see docstring).
    assert passes == 20
    assert preemptions_total == 6
    assert num_events == 16
    assert removed_events == 6
    assert indexer.ok_count("stored") == 10
    assert indexer.ok_count("removed") == 6
