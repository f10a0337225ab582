"""Twins of the seed's `core_behavior` module (dynamo-mocker 1.3.0, vllm/tests.rs)."""

from __future__ import annotations

from engined.core.args import PreemptionMode, WorkerType
from engined.core.state import RequestState
from engined.core.types import (
    AllBlocksCleared,
    Applied,
    Cancel,
    FinishReason,
    Refused,
    RequestStatus,
    ResetPrefixCache,
)
from tests.core.factories import (
    MOCKER_1_3_0,
    active_blocks,
    emitted_tokens,
    finished,
    inactive_blocks,
    lineage_kv,
    make_args,
    make_core,
    output_of,
    request,
    run_until_empty,
    submit,
    tokens_of,
    uid,
    view,
)


def test_planned_output_tokens_are_emitted_exactly() -> None:
    """1. Submit prompt [1, 2] with planned output [101, 202, 303].
    2. Run three passes.
    Result: exactly the planned ids are emitted, in order, and the core is empty.
    """
    core = make_core()
    rid = uid(0xA11CE)
    planned = [101, 202, 303]
    submit(core, request(rid, [1, 2], len(planned), output_token_ids=planned))
    emitted = []
    for step in range(len(planned)):
        result = core.execute_pass(float(step))
        emitted += tokens_of(result, rid)
    assert emitted == planned
    assert core.is_empty()


def test_unified_pass_keeps_partial_prefill_in_running() -> None:
    """1. Budget 12, two 8-token prompts. 2. One pass.
    Result: r1 prefills fully and samples its first token (which allocates its third block at
    once), r2 prefills 4 tokens and stays running: 1 output, running [r1, r2], computed 8/4,
    4 active blocks.
    """
    core = make_core(make_args(max_num_batched_tokens=12))
    r1, r2 = uid(1), uid(2)
    submit(core, request(r1, range(8), 2))
    submit(core, request(r2, range(100, 108), 2))
    result = core.execute_pass(0.0)
    assert len(result.request_outputs()) == 1
    assert len(core.queues().waiting) == 0
    assert result.metrics.running == 2
    assert result.metrics.waiting == 0
    assert core.queues().running == [r1, r2]
    assert view(core, r1).num_computed_tokens == 8
    assert view(core, r2).num_computed_tokens == 4
    assert view(core, r1).output_tokens == 1
    assert view(core, r2).status is RequestStatus.RUNNING
    assert active_blocks(core) == 4


def test_running_requests_consume_budget_before_waiting() -> None:
    """1. Budget 4, 16 blocks, two 8-token prompts. 2. Two passes.
    Result: r1 emits in pass 2 and r2 has computed nothing: the running request caught up first.
    """
    core = make_core(make_args(num_gpu_blocks=16, max_num_batched_tokens=4))
    r1, r2 = uid(1), uid(2)
    submit(core, request(r1, range(8), 2))
    submit(core, request(r2, range(100, 108), 2))
    core.execute_pass(0.0)
    result = core.execute_pass(1.0)
    assert output_of(result, r1) is not None
    assert view(core, r2).num_computed_tokens == 0


def test_execute_pass_batches_two_ready_requests_together() -> None:
    """1. Budget 8, two 4-token prompts with one output token each. 2. One pass.
    Result: both admitted in the same pass (same admission time) and both tokens emitted in it
    (same token time: the pass's end).
    """
    core = make_core(make_args(num_gpu_blocks=16, max_num_seqs=4))
    r1, r2 = uid(101), uid(202)
    submit(core, request(r1, [1] * 4, 1))
    submit(core, request(r2, [2] * 4, 1))
    result = core.execute_pass(0.0)
    assert [a.request_id for a in result.admissions] == [r1, r2]
    assert [out.request_id for out in result.request_outputs()] == [r1, r2]
    assert result.end_ms > 0.0


def test_prefill_completion_emits_handoff_delay() -> None:
    """1. Prefill worker, 1 GB/s, 1e6 bytes per token, an 8-token prompt with one output.
    Result: the completing output carries a handoff delay of 8.0 ms.
    """
    core = make_core(
        make_args(
            num_gpu_blocks=8,
            max_num_seqs=1,
            enable_prefix_caching=True,
            worker_type=WorkerType.PREFILL,
            kv_transfer_bandwidth=1.0,
            kv_bytes_per_token=1_000_000,
        )
    )
    submit(core, request(uid(81), [1] * 8, 1))
    out = core.execute_pass(0.0).request_outputs()[0]
    assert out.finish_reason is FinishReason.LENGTH
    assert out.handoff_delay_ms == 8.0


def test_first_token_can_arrive_on_prompt_completion_pass() -> None:
    """An 8-token prompt within budget emits its first token in the pass that prefills it."""
    core = make_core()
    rid = uid(11)
    submit(core, request(rid, range(8), 2))
    result = core.execute_pass(0.0)
    assert len(result.request_outputs()) == 1
    assert result.request_outputs()[0].request_id == rid
    assert result.request_outputs()[0].finish_reason is None
    assert view(core, rid).output_tokens == 1


def test_preemption_requeues_newest_running_request() -> None:
    """1. 6 blocks, 2 seqs, LIFO, two 8-token prompts with 8 outputs. 2. Pass until the first
    preemption.
    Result: r2 (the newest) is preempted at pass 5: status Preempted, computed 0, one
    preemption, front of the waiting queue; the engine counts exactly one preemption.
    """
    core = make_core(
        make_args(max_num_batched_tokens=16, max_num_seqs=2, preemption_mode=PreemptionMode.LIFO)
    )
    r1, r2 = uid(1), uid(2)
    submit(core, request(r1, range(8), 8))
    submit(core, request(r2, range(100, 108), 8))
    now = 0.0
    preemptions = 0
    passes = 0
    for _ in range(16):
        result = core.execute_pass(now)
        passes += 1
        now = max(result.end_ms, now + 1.0)
        preemptions = result.metrics.preemptions_total
        if preemptions > 0:
            break
    assert passes == 5
    victim = view(core, r2)
    assert victim.status is RequestStatus.PREEMPTED
    assert victim.num_computed_tokens == 0
    assert victim.num_preemptions == 1
    assert core.queues().waiting[0] == r2
    assert preemptions == 1


def test_waiting_full_isl_gate_blocks_without_preemption_then_admits() -> None:
    """1. 6 blocks; holder (16 tokens, 1 output), blocked (12 tokens), follower (4 tokens).
    2. Pass 1: the holder takes 4 blocks; 'blocked' needs 3 > 2 available and waits, and the
    smaller follower may not skip it. The holder completes.
    3. Pass 2.
    Result: 'blocked' is admitted in pass 2; no preemption ever happened.
    """
    core = make_core(make_args(max_num_batched_tokens=16, preemption_mode=PreemptionMode.LIFO))
    holder, blocked, follower = uid(1), uid(2), uid(3)
    submit(core, request(holder, range(16), 1))
    submit(core, request(blocked, range(100, 112), 1))
    submit(core, request(follower, range(200, 204), 1))
    pass1 = core.execute_pass(0.0)
    assert list(core.queues().waiting) == [blocked, follower]
    assert [a.request_id for a in pass1.admissions] == [holder]
    assert finished(pass1, holder)
    assert view(core, blocked).num_computed_tokens == 0
    assert pass1.metrics.preemptions_total == 0
    assert active_blocks(core) == 0
    pass2 = core.execute_pass(max(pass1.end_ms, 1.0))
    assert blocked in [a.request_id for a in pass2.admissions]
    assert pass2.metrics.preemptions_total == 0


def test_fresh_request_larger_than_pool_is_rejected_and_follower_runs() -> None:
    """1. 4 blocks, a 20-token prompt (5 blocks) and a 4-token follower. 2. One pass.
    Result: the oversized request ends with a rejected output and no token; the follower is
    admitted in the same pass; no preemption.
    """
    core = make_core(make_args(num_gpu_blocks=4, max_num_batched_tokens=32, max_num_seqs=2))
    oversized, follower = uid(1), uid(2)
    submit(core, request(oversized, range(20), 1))
    submit(core, request(follower, range(100, 104), 1))
    result = core.execute_pass(0.0)
    refused = [out for out in result.request_outputs() if out.request_id == oversized]
    assert len(refused) == 1
    assert refused[0].finish_reason is FinishReason.REJECTED and refused[0].new_token_ids == []
    assert (oversized, FinishReason.REJECTED) in [(e.request_id, e.reason) for e in result.ended]
    assert [a.request_id for a in result.admissions] == [follower]
    assert result.metrics.preemptions_total == 0
    assert core.inspect(oversized) is None


def test_running_request_catches_up_decode_tail_before_promote() -> None:
    """Hand-built decode state (the seed pokes the same internals):
    1. A 6-token prompt (bs 4, caching on) is allocated ([F1, P2]: 2 blocks), generates six
       tokens with their block moves applied (allocated 12, 3 active), then releases all
       (0 active) and re-takes only its prompt blocks (2 inactive hits: 2 active).
    2. It is inserted as Running with 9 computed tokens (one preemption), and one pass runs.
    Result: the pass computes the decode tail up to 12 (allocating block 3), samples token 13
    which promotes block 3 and opens block 4: 1 signal, computed 12, allocated 13, 4 active.
    """
    core = make_core(
        make_args(
            num_gpu_blocks=8, max_num_batched_tokens=8, max_num_seqs=1, enable_prefix_caching=True
        )
    )
    rid = uid(99)
    parts = core.parts
    seq = parts.intake.build(request(rid, range(6), 16), rid, RequestStatus.RUNNING).seq
    creation = seq.prepare_allocation(len(seq))
    assert creation is not None and creation.num_blocks == 2
    assert lineage_kv(core).use(creation, 0.0)
    seq.num_allocated_tokens = len(seq)
    for _ in range(6):
        _, moves = seq.generate_token()
        assert parts.kv.apply_all(moves, 0.0)
        if seq.generated < seq.max_output_tokens:
            seq.num_allocated_tokens = len(seq)
    assert seq.num_allocated_tokens == 12
    assert active_blocks(core) == 3
    assert parts.kv.apply_all(seq.reset_with_moves(), 0.0)
    assert active_blocks(core) == 0
    prompt_only = seq.prepare_allocation(seq.num_input_tokens)
    assert prompt_only is not None and prompt_only.num_blocks == 2
    assert lineage_kv(core).use(prompt_only, 0.0)
    seq.num_allocated_tokens = seq.num_input_tokens
    assert active_blocks(core) == 2

    parts.state.requests[rid] = RequestState(
        rid, seq, RequestStatus.RUNNING, num_computed_tokens=9, num_preemptions=1
    )
    parts.state.transition_to_running(rid)
    result = core.execute_pass(0.0)
    req = view(core, rid)
    assert len(result.request_outputs()) == 1
    assert req.num_computed_tokens == 12
    assert req.num_allocated_tokens == 13
    assert active_blocks(core) == 4


def test_completion_returns_scheduler_to_idle() -> None:
    """Two 8-token prompts with two outputs each run to completion; nothing stays allocated."""
    core = make_core()
    for n in (1, 2):
        submit(core, request(uid(n), range(8), 2))
    while not core.is_empty():
        core.execute_pass(0.0)
    assert not core.queues().waiting
    assert not core.queues().running
    assert active_blocks(core) == 0


def test_mtp_batch_applies_request_bursts_in_stable_order() -> None:
    """1. MTP nextn 2 with rates 1,1 (every burst is 3 tokens); 'short' (max 5) and 'long'
    (max 8), 4-token prompts.
    2. Pass 1: both prefill and burst 3 tokens each (6 tokens).
    3. Pass 2: short emits its last 2 tokens (the second completes it), then long bursts 3.
    Result: one output per request in running order; long has generated 6 with one
    dangling token; FPM counts 2 decode requests, not 5 tokens.
    """
    core = make_core(
        make_args(
            num_gpu_blocks=16,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            aic_nextn=2,
            aic_nextn_accept_rates="1,1",
        )
    )
    short, long = uid(1), uid(2)
    submit(core, request(short, range(4), 5))
    submit(core, request(long, range(100, 104), 8))
    first = core.execute_pass(0.0)
    assert emitted_tokens(first) == 6
    second = core.execute_pass(first.end_ms)
    assert [
        (out.request_id, len(out.new_token_ids), out.finish_reason)
        for out in second.request_outputs()
    ] == [(short, 2, FinishReason.LENGTH), (long, 3, None)]
    req = view(core, long)
    assert req.output_tokens == 6
    assert req.num_tokens - req.num_computed_tokens == 1
    assert second.fpm.num_decode_requests == 2


def test_mtp_releases_unused_block_reservations() -> None:
    """1. bs 2, MTP nextn 2 with rates 0,1 (bursts of 1), a 3-token prompt.
    2. One pass: prefill takes 2 blocks, the MTP reservation one more, the burst uses none.
    Result: 1 token, and the unused reserved block is returned: 2 active blocks.
    """
    core = make_core(
        make_args(
            block_size=2,
            num_gpu_blocks=8,
            max_num_seqs=2,
            aic_nextn=2,
            aic_nextn_accept_rates="0,1",
        )
    )
    rid = uid(3)
    submit(core, request(rid, range(3), 5))
    result = core.execute_pass(0.0)
    assert emitted_tokens(result) == 1
    assert active_blocks(core) == 2
    req = view(core, rid)
    assert req.output_tokens == 1
    assert req.num_tokens - req.num_computed_tokens == 1


def test_zero_output_request_completes_after_prefill_without_token() -> None:
    """max_tokens 0 (upstream 1.3.0 never completes it; we follow the later fix).
    1. A 6-token prompt with max_tokens 0. 2. One pass.
    Result: one output, finished by length, with no token, and every block freed.
    """
    core = make_core()
    rid = uid(5)
    submit(core, request(rid, range(6), 0))
    result = core.execute_pass(0.0)
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in result.request_outputs()] == [
        (rid, [], FinishReason.LENGTH)
    ]
    assert result.fpm.num_prefill_requests == 1
    assert result.fpm.num_decode_requests == 0
    assert core.is_empty()
    assert active_blocks(core) == 0


def test_same_inputs_give_identical_runs() -> None:
    """Two cores with the same args and inputs produce identical outputs, events and times."""

    def run() -> list[tuple[object, ...]]:
        core = make_core(make_args(enable_prefix_caching=True, num_gpu_blocks=10, seed=7))
        for n in range(6):
            submit(core, request(uid(n), [n % 2] * 4 + list(range(n, n + 5)), 5))
        out: list[tuple[object, ...]] = []
        for result in run_until_empty(core):
            out.append((result.end_ms, result.request_outputs(), result.kv_events, result.fpm))
        return out

    assert run() == run()


def test_fifo_preemption_can_ping_pong_as_upstream() -> None:
    """Known upstream behaviour, kept on purpose (README, limits).
    1. FIFO preemption, MTP bursts of 2, 7 blocks of 3 tokens: a 15-token request and a
       2-token request whose blocks cannot coexist with the long one's next burst.
    2. Run 40 passes.
    Result: the oldest running request is the victim each time it needs a block, so the two
    take turns preempting each other: one preemption per pass, no completion; cancelling
    both frees every block.
    """
    core = make_core(
        make_args(
            block_size=3,
            num_gpu_blocks=7,
            max_num_batched_tokens=2,
            enable_prefix_caching=True,
            preemption_mode=PreemptionMode.FIFO,
            aic_nextn=1,
            aic_nextn_accept_rates="1",
            # Under vLLM's rule a re-admitted victim hits its own generated blocks, the
            # recompute shrinks and the ping-pong ends; the upstream quirk needs 1.3.0's.
            prefix_hit_rule=MOCKER_1_3_0,
        )
    )
    submit(core, request("long", [0] * 15, 4, output_token_ids=[0] * 4))
    submit(core, request("short", [0] * 2, 2))
    submit(core, request("single", [0] * 9, 1, output_token_ids=[0]))
    now = 0.0
    totals = []
    for _ in range(40):
        result = core.execute_pass(now)
        now = result.end_ms
        totals.append(result.metrics.preemptions_total)
    assert totals[-10:] == list(range(totals[-10], totals[-10] + 10))
    queues = core.queues()
    assert set(queues.waiting + queues.running) == {"long", "short"}
    for request_id in ("long", "short"):
        assert core.apply(Cancel(request_id), now_ms=now).result == Applied()
    assert active_blocks(core) == 0


def test_reset_prefix_cache_clears_only_an_idle_pool() -> None:
    """1. With caching on, run a request to completion (its blocks stay cached, inactive).
    2. Reset while another request holds blocks: refused, nothing published.
    3. Finish it, reset again.
    Result: the second reset succeeds, publishes one AllBlocksCleared with the next event id,
    and a repeat of the first prompt finds nothing cached.
    """
    core = make_core(make_args(enable_prefix_caching=True, num_gpu_blocks=12))
    submit(core, request("a", range(8), 1))
    events = [e for r in run_until_empty(core) for e in r.kv_events]
    assert inactive_blocks(core) == 2
    submit(core, request("b", range(100, 104), 2))
    events += core.execute_pass(0.0).kv_events
    refused = core.apply(ResetPrefixCache(), now_ms=0.0)
    assert isinstance(refused.result, Refused)
    assert refused.kv_events == []
    events += [e for r in run_until_empty(core) for e in r.kv_events]
    reset = core.apply(ResetPrefixCache(), now_ms=0.0)
    assert reset.result == Applied()
    assert reset.kv_events == [AllBlocksCleared(events[-1].event_id + 1, 0)]
    assert inactive_blocks(core) == 0
    submit(core, request("c", range(8), 1))
    assert core.execute_pass(0.0).admissions[0].reused_input_tokens == 0
