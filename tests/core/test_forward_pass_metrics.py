"""Twins of the seed's `forward_pass_metrics` module (docs/upstream/seed-tests.md), except
`test_fpm_sent_through_sink`, which needs the live loop.

Each test runs core passes directly (`Engine::new`: dp_rank 0, worker 0, no KV capture) and
checks the pass's FpmSnapshot. Where the seed is lenient, exact values are added, derived in the
comments from docs/upstream/dynamo-mocker.md: §4.2 (what a pass schedules, `ScheduledWork`), §4.7
(FPM: prefills = scheduled work with prompt tokens, decodes = the rest measured by the sequence
length at schedule time, queued prefill/decode from the waiting queue), §4.3-§4.4 and §4.6
(admission, emission, preemption) and §5 (pass timing).
"""

from __future__ import annotations

from typing import Any

import pytest

from engined.core.args import EngineArgs, PreemptionMode
from engined.core.state import RequestStatus
from tests.core.factories import (
    active_blocks,
    finishes,
    make_args,
    make_core,
    request,
    submit,
    uid,
    view,
)


def fpm_args(**overrides: Any) -> EngineArgs:
    """The seed's `fpm_args()`: bs 4, 16 blocks, budget 16, 4 seqs, chunked, no prefix caching."""
    fields: dict[str, Any] = {
        "num_gpu_blocks": 16,
        "max_num_batched_tokens": 16,
        "max_num_seqs": 4,
    }
    fields.update(overrides)
    return make_args(**fields)


def test_fpm_single_prefill_request() -> None:
    """A lone prompt is one prefill of all its tokens.

    1. Core with fpm_args (bs 4, 16 blocks, budget 16, 4 seqs, no prefix caching).
    2. Submit request 1: prompt 0..8, max_tokens 1.
    3. Run one pass at t=0.

    Expected FPM: 1 prefill request of 8 tokens, 0 prefix-cached KV tokens, no decode, nothing
    queued, positive wall time. Exact wall time from docs/upstream/dynamo-mocker.md §5 (this very
    example): prefill 16.6229144639296 ms + decode 12.0890625 ms (2 active blocks of 16: p = 8/64).
    """
    core = make_core(fpm_args())
    submit(core, request(uid(1), range(8), 1))

    result = core.execute_pass(0.0)
    fpm = result.fpm

    assert fpm.num_prefill_requests == 1
    assert fpm.sum_prefill_tokens == 8, "all 8 prompt tokens computed"
    assert fpm.sum_prefill_kv_tokens == 0, "no prefix cache"
    assert fpm.num_decode_requests == 0
    assert fpm.num_queued_prefill == 0
    assert fpm.num_queued_decode == 0
    assert fpm.wall_time_secs > 0.0

    # Exact values: single request -> zero variance; timing from §5 (Duration rounding to the
    # nanosecond is within the tolerance).
    assert fpm.var_prefill_length == 0.0
    assert fpm.sum_decode_kv_tokens == 0
    assert fpm.wall_time_secs == pytest.approx((16.6229144639296 + 12.0890625) / 1000, abs=1e-8)
    assert result.end_ms == pytest.approx(16.6229144639296 + 12.0890625, abs=1e-5)


def test_fpm_prefill_and_decode_mixed_batch() -> None:
    """A decode and a prefill in one pass are counted separately.

    1. Core with fpm_args.
    2. Submit r1: prompt 0..4, max_tokens 3. Pass 1 at t=0: r1 prefills 4 tokens and samples
       its first token.
    3. Submit r2: prompt 100..104, max_tokens 3. Pass 2 at t=1: r1 decodes, r2 prefills.

    Expected: pass 1 has 1 prefill of 4 tokens; pass 2 has 1 prefill (r2, 4 tokens) and 1
    decode (r1) with KV context. Exact: r1's decode is measured by its sequence length at
    schedule time, 4 prompt + 1 generated = 5 (§4.7); both requests emit a token in pass 2.
    """
    core = make_core(fpm_args())

    # r1: 4-token prompt, 3 output tokens
    r1 = uid(1)
    submit(core, request(r1, range(4), 3))

    # Pass 1: prefill r1 (4 tokens) + first decode token
    pass1 = core.execute_pass(0.0)
    fpm1 = pass1.fpm
    assert fpm1.num_prefill_requests == 1
    assert fpm1.sum_prefill_tokens == 4
    # Exact: nothing was running before r1, so no decode (§4.7).
    assert fpm1.num_decode_requests == 0
    assert finishes(pass1) == [(r1, False)]

    # r2: 4-token prompt arriving while r1 is decoding
    r2 = uid(2)
    submit(core, request(r2, range(100, 104), 3))

    # Pass 2: r1 decode + r2 prefill (mixed batch)
    pass2 = core.execute_pass(1.0)
    fpm2 = pass2.fpm
    assert fpm2.num_prefill_requests == 1, "r2 is prefilling"
    assert fpm2.num_decode_requests == 1, "r1 is decoding"
    assert fpm2.sum_prefill_tokens == 4
    assert fpm2.sum_decode_kv_tokens > 0, "decode request should have KV context"

    # Exact values (see docstring).
    assert fpm2.sum_decode_kv_tokens == 5
    assert fpm2.var_decode_kv_tokens == 0.0
    assert fpm2.sum_prefill_kv_tokens == 0
    assert fpm2.num_queued_prefill == 0
    assert fpm2.num_queued_decode == 0
    assert finishes(pass2) == [
        (r1, False),
        (r2, False),
    ]


def test_fpm_completed_requests_metrics_correct() -> None:
    """A request that completes in its prefill pass still counts as that pass's prefill.

    1. Core with fpm_args.
    2. Submit r1: prompt 0..4, max_tokens 1.
    3. Run one pass at t=0 (prefill + the only token: r1 completes and leaves the state).

    Expected: 1 prefill request of 4 tokens although r1 is gone when the FPM is built, and the
    pass reports a completed request. Exact: exactly 1 completed request, zero variance (one
    prompt of length 4), no decode, and the completing token is r1's only signal.
    """
    # This tests the fix: completed requests should still contribute correct metrics even
    # though they're removed from state before compute_fpm runs.
    core = make_core(fpm_args())

    # Request with 4-token prompt and 1 output token: completes in 1 pass
    r1 = uid(1)
    submit(core, request(r1, range(4), 1))

    result = core.execute_pass(0.0)
    fpm = result.fpm

    # r1 completes in this pass. The bug was that prompt_len would be 0 because the request
    # was removed from state before compute_fpm ran.
    assert fpm.num_prefill_requests == 1
    assert fpm.sum_prefill_tokens == 4
    assert len(result.ended) > 0, "request should have completed"

    # Exact values (see docstring; §4.1 completed_requests = requests_before - after).
    assert len(result.ended) == 1
    assert fpm.var_prefill_length == 0.0
    assert fpm.num_decode_requests == 0
    assert finishes(result) == [(r1, True)]
    assert core.inspect(r1) is None


def test_fpm_completed_decode_request_has_kv_context() -> None:
    """A decode that completes in its pass still reports its KV context.

    1. Core: bs 4, 16 blocks, budget 16, 4 seqs, no prefix caching.
    2. Submit r1: prompt 0..4, max_tokens 2.
    3. Pass 1 at t=0: prefill + first token. Pass 2 at t=1: second token, r1 completes.

    Expected: pass 2 has 1 decode request with KV context > 0. Exact: that context is r1's
    sequence length at schedule time, 4 prompt + 1 generated = 5 (§4.7), there is no prefill,
    and r1 completes in pass 2.
    """
    core = make_core(
        make_args(
            num_gpu_blocks=16,
            max_num_batched_tokens=16,
            max_num_seqs=4,
            enable_chunked_prefill=True,
            enable_prefix_caching=False,
        )
    )

    r1 = uid(1)
    submit(core, request(r1, range(4), 2))

    # Pass 1: prefill + first decode token
    core.execute_pass(0.0)

    # Pass 2: second decode token (completes the request)
    pass2 = core.execute_pass(1.0)
    fpm2 = pass2.fpm

    assert fpm2.num_decode_requests == 1
    # The completed decode request should have contributed its KV context
    # (prompt_len + generated_so_far at schedule time).
    assert fpm2.sum_decode_kv_tokens > 0, (
        f"completed decode request should still contribute KV context, "
        f"got {fpm2.sum_decode_kv_tokens}"
    )

    # Exact values (see docstring).
    assert fpm2.sum_decode_kv_tokens == 5
    assert fpm2.num_prefill_requests == 0
    assert fpm2.sum_prefill_tokens == 0
    assert len(pass2.ended) == 1
    assert finishes(pass2) == [(r1, True)]


def test_fpm_queued_requests() -> None:
    """A request left waiting is reported as a queued prefill.

    1. Core: bs 4, 4 blocks, budget 8, 2 seqs, no prefix caching.
    2. Submit r1 (prompt 0..8) and r2 (prompt 100..108), max_tokens 1 each.
    3. Run one pass at t=0.

    Expected: at least one request scheduled. Exact (§4.1-§4.3, §4.7): r1 is admitted and
    takes the whole budget of 8 tokens (2 blocks); r2 passes the admission gate (2 blocks
    needed, 4 - 2 = 2 available) but gets 0 tokens (`desired == 0`: OffloadWait), so it stays
    Waiting, is not admitted, and is the one queued prefill of 8 tokens. r1 emits its only
    token and completes, freeing all its blocks.
    """
    core = make_core(
        make_args(
            num_gpu_blocks=4,  # Very limited KV: only room for one request
            max_num_batched_tokens=8,
            max_num_seqs=2,
        )
    )

    # r1 and r2 both have 8-token prompts but only 4 blocks available
    r1 = uid(1)
    r2 = uid(2)
    submit(core, request(r1, range(8), 1))
    submit(core, request(r2, range(100, 108), 1))

    result = core.execute_pass(0.0)
    fpm = result.fpm

    # At least one request should be scheduled, the other might be queued (depending on KV
    # capacity). Some requests may have completed and been removed from both scheduled and
    # queued.
    total_scheduled = fpm.num_prefill_requests + fpm.num_decode_requests
    assert total_scheduled >= 1, "at least one request should be scheduled"

    # Exact values (see docstring).
    assert fpm.num_prefill_requests == 1
    assert fpm.sum_prefill_tokens == 8
    assert fpm.num_decode_requests == 0
    assert fpm.num_queued_prefill == 1
    assert fpm.sum_queued_prefill_tokens == 8
    assert fpm.var_queued_prefill_length == 0.0
    assert fpm.num_queued_decode == 0
    assert [a.request_id for a in result.admissions] == [r1]
    assert finishes(result) == [(r1, True)]
    assert len(result.ended) == 1
    assert list(core.queues().waiting) == [r2]
    assert view(core, r2).status is RequestStatus.WAITING
    assert view(core, r2).num_computed_tokens == 0
    assert active_blocks(core) == 0


def test_fpm_var_prefill_length_with_multiple_requests() -> None:
    """The prefill-length variance is the population variance of the prompt lengths.

    1. Core: bs 4, 32 blocks, budget 32, 4 seqs, no prefix caching.
    2. Submit request 1 (prompt 0..4) and request 2 (prompt 100..112), max_tokens 1 each.
    3. Run one pass at t=0.

    Expected: 2 prefill requests; variance of [4, 12] = ((4-8)^2 + (12-8)^2) / 2 = 16. Exact:
    both prompts fit the budget, so 16 prefill tokens, and both complete in the pass.
    """
    core = make_core(make_args(num_gpu_blocks=32, max_num_batched_tokens=32, max_num_seqs=4))

    # Two prefill requests with different prompt lengths
    submit(core, request(uid(1), range(4), 1))  # prompt_len = 4
    submit(core, request(uid(2), range(100, 112), 1))  # prompt_len = 12

    result = core.execute_pass(0.0)
    fpm = result.fpm

    assert fpm.num_prefill_requests == 2
    # Population variance of [4, 12]: mean=8, var=((4-8)^2+(12-8)^2)/2 = 16
    assert abs(fpm.var_prefill_length - 16.0) < 1e-6, (
        f"expected var=16.0, got {fpm.var_prefill_length}"
    )

    # Exact values (see docstring).
    assert fpm.sum_prefill_tokens == 16
    assert fpm.sum_prefill_kv_tokens == 0
    assert fpm.num_decode_requests == 0
    assert len(result.ended) == 2


def test_fpm_chunked_prefill_reports_chunk_not_full_prompt() -> None:
    """Chunked prefill reports each pass's chunk, not the whole prompt.

    1. Core: bs 4, 16 blocks, budget 8, 4 seqs, chunked, no prefix caching.
    2. Submit request 1: prompt 0..16, max_tokens 2.
    3. Pass 1 at t=0 (first chunk), pass 2 at t=1 (second chunk).

    Expected: each pass has 1 prefill request of at most 8 tokens, the two chunks sum to 16,
    and the variance (over the full prompt length) is 0 in both. Exact (§4.2): the budget cuts
    the prompt into 8 + 8; the second chunk already has 8 computed tokens as its prefix
    (`sum_prefill_kv_tokens`); the first token comes only in pass 2, when the prompt is done.
    """
    core = make_core(make_args(num_gpu_blocks=16, max_num_batched_tokens=8, max_num_seqs=4))
    submit(core, request(uid(1), range(16), 2))

    # Pass 1: first chunk
    pass1 = core.execute_pass(0.0)
    fpm1 = pass1.fpm
    assert fpm1.num_prefill_requests == 1
    assert fpm1.sum_prefill_tokens <= 8, (
        f"chunk should be at most 8 tokens, got {fpm1.sum_prefill_tokens}"
    )
    assert fpm1.sum_prefill_tokens > 0

    # Pass 2: remaining chunk
    pass2 = core.execute_pass(1.0)
    fpm2 = pass2.fpm
    assert fpm2.num_prefill_requests == 1, "still prefilling"
    assert fpm2.sum_prefill_tokens <= 8, (
        f"second chunk should also be at most 8 tokens, got {fpm2.sum_prefill_tokens}"
    )

    # Total across both chunks should equal the full prompt length
    assert fpm1.sum_prefill_tokens + fpm2.sum_prefill_tokens == 16, (
        "total prefill tokens across chunks should equal full prompt"
    )

    # Variance should be over the full prompt length (16) in both passes
    assert fpm1.var_prefill_length == 0.0, "single request -> zero variance"
    assert fpm2.var_prefill_length == 0.0, "single request -> zero variance"

    # Exact values (see docstring).
    assert fpm1.sum_prefill_tokens == 8
    assert fpm2.sum_prefill_tokens == 8
    assert fpm1.sum_prefill_kv_tokens == 0
    assert fpm2.sum_prefill_kv_tokens == 8
    assert fpm1.num_decode_requests == 0
    assert fpm2.num_decode_requests == 0
    assert pass1.request_outputs() == []
    assert finishes(pass2) == [(uid(1), False)]


def test_fpm_preemption_creates_queued_decode() -> None:
    """A request preempted in a pass shows up as a queued decode in that pass's FPM.

    1. Core: bs 4, 6 blocks (24 tokens of KV), budget 32, 3 seqs, no prefix caching, LIFO.
    2. Submit r1: prompt 0..4, max_tokens 20. Passes at t=0, 1, 2: r1 prefills and samples 3
       tokens (length 7; it holds 2 blocks: its prompt block and the partial block that token
       1 opened).
    3. Submit r2: prompt 100..116 (16 tokens), max_tokens 5. Pass at t=3.

    Expected (seed): if anything is queued and it is a queued decode, the queued decode has KV
    context; at least one request is scheduled.
    Exact (§4.1-§4.4, §4.6, §4.7, §5): in the pass at t=3, r1 is scheduled as a decode of
    length 7; r2 passes the gate (4 blocks needed, 6 - 2 = 4 available), is admitted and
    prefills all 16 tokens (6 blocks active). In emission r1's token 8 needs no block, but
    r2's first token (length 17) opens a fifth block for r2 and the pool is full, so LIFO
    preempts r2 itself: it goes back to the head of the queue with its generated token undone
    (length 16, 0 generated, 0 computed) and emits nothing. Its scheduled prefill stays in the
    FPM (emission does not undo scheduled work), and the queue now holds it as a Preempted
    entry, counted as a queued decode of prompt + generated = 16 tokens. The pass time is the
    prefill of 16 tokens (16.744462816 ms) plus the decode at full occupancy (p = 24/24:
    -25.74 + 54.01 + 5.74 = 34.01 ms), measured before sampling.
    """
    core = make_core(
        make_args(
            num_gpu_blocks=6,  # 24 tokens of KV: very tight
            max_num_batched_tokens=32,
            max_num_seqs=3,
            preemption_mode=PreemptionMode.LIFO,
        )
    )
    r1 = uid(1)
    r2 = uid(2)

    # r1: 4-token prompt, long output (stays running)
    submit(core, request(r1, range(4), 20))

    # Prefill r1 and decode a few tokens to build up KV
    core.execute_pass(0.0)
    core.execute_pass(1.0)
    core.execute_pass(2.0)
    # Exact: 4 prompt + 3 sampled tokens in 2 blocks (§4.4 eager allocation at length 5).
    assert view(core, r1).num_tokens == 7
    assert active_blocks(core) == 2

    # r2: another request that will compete for KV
    submit(core, request(r2, range(100, 116), 5))  # 16 tokens: will pressure KV

    # This pass should trigger preemption
    result = core.execute_pass(3.0)
    fpm = result.fpm

    # We should see at least one queued decode (preempted request) OR one queued prefill (if
    # the new request couldn't be scheduled). The key assertion is that queued metrics are
    # non-zero when KV pressure exists.
    total_queued = fpm.num_queued_prefill + fpm.num_queued_decode
    if total_queued > 0 and fpm.num_queued_decode > 0:
        # Preemption occurred: verify the preempted decode has KV context
        assert fpm.sum_queued_decode_kv_tokens > 0, "preempted decode should have KV context"
    # Regardless, at least one request should be scheduled
    total_scheduled = fpm.num_prefill_requests + fpm.num_decode_requests
    assert total_scheduled >= 1

    # Exact values (see docstring).
    assert result.metrics.preemptions_total == 1
    assert [a.request_id for a in result.admissions] == [r2]
    assert finishes(result) == [(r1, False)]
    assert fpm.num_prefill_requests == 1
    assert fpm.sum_prefill_tokens == 16
    assert fpm.sum_prefill_kv_tokens == 0
    assert fpm.num_decode_requests == 1
    assert fpm.sum_decode_kv_tokens == 7
    assert fpm.num_queued_prefill == 0
    assert fpm.sum_queued_prefill_tokens == 0
    assert fpm.num_queued_decode == 1
    assert fpm.sum_queued_decode_kv_tokens == 16
    assert fpm.var_queued_decode_kv_tokens == 0.0
    assert fpm.wall_time_secs == pytest.approx((16.744462816 + 34.01) / 1000, abs=1e-8)

    preempted = view(core, r2)
    assert preempted.status is RequestStatus.PREEMPTED
    assert preempted.num_preemptions == 1
    assert preempted.num_computed_tokens == 0
    assert preempted.num_tokens == 16
    assert preempted.output_tokens == 0
    assert list(core.queues().waiting) == [r2]
    assert core.queues().running == [r1]
    assert active_blocks(core) == 2
