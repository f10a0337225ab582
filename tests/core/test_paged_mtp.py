"""MTP under vLLM 0.33's semantics, one rule a test (engined/core/paged/spec_decode.py).

The expectations are vLLM's scheduler's for the same stream with `method: mtp` and
`num_speculative_tokens` drafts (the parity harness checks whole streams against the real
one: docs/parity.md, the `-mtp` scenarios): a decode step schedules its token and the drafts
proposed after the last step, with as many lookahead slots past them; rejected drafts come
off the computed tokens; a one-token admission beside decodes is padded with placeholder
drafts; with prefix caching a block's hash covers the token after it.
"""

from __future__ import annotations

from typing import Any

import pytest

from engined.core.args import EngineArgs, Semantics
from engined.core.engine import Engine
from engined.core.errors import InvalidArgsError
from engined.core.types import BlockStored, PassResult
from engined.core.vllm_hashing import (
    DEFAULT_HASH_ALGO,
    BlockHasher,
    event_block_hash_int,
    none_hash,
)
from tests.core.factories import make_args, passes, request, shares, submit


def mtp_args(nextn: int, rates: str, **overrides: Any) -> EngineArgs:
    """bs 4, 16 blocks, budget 64, vLLM semantics, prefix caching off, `nextn` drafts."""
    fields: dict[str, Any] = {
        "semantics": Semantics.VLLM,
        "num_gpu_blocks": 16,
        "max_num_batched_tokens": 64,
        "aic_nextn": nextn,
        "aic_nextn_accept_rates": rates,
    }
    fields.update(overrides)
    return make_args(**fields)


def bursts(result: PassResult) -> dict[str, int]:
    """How many tokens each request's output carried this pass."""
    return {o.request_id: len(o.new_token_ids) for o in result.request_outputs()}


def test_a_decode_step_schedules_its_drafts_and_emits_the_accepted_ones() -> None:
    """Every draft accepted: after the prefill's first token, each step schedules 1 + 2
    tokens and emits all three."""
    core = Engine(mtp_args(2, "1,1"), record=True)
    submit(core, request("a", range(6), 7))
    results = passes(core, 3)
    assert [shares(r) for r in results] == [[("a", 0, 6)], [("a", 6, 3)], [("a", 9, 3)]]
    assert [bursts(r) for r in results] == [{"a": 1}, {"a": 3}, {"a": 3}]
    assert core.is_empty()


def test_rejected_drafts_are_rolled_back_from_the_computed_tokens() -> None:
    """No draft accepted: each step still schedules 1 + 2 tokens, emits one, and the next
    step starts from the last known token again (computed 7, not 9)."""
    core = Engine(mtp_args(2, "0,0"), record=True)
    submit(core, request("a", range(6), 3))
    results = passes(core, 3)
    assert [shares(r) for r in results] == [[("a", 0, 6)], [("a", 6, 3)], [("a", 7, 3)]]
    assert [bursts(r) for r in results] == [{"a": 1}, {"a": 1}, {"a": 1}]
    assert core.is_empty()


def test_max_model_len_cuts_the_drafts_a_step_schedules() -> None:
    """At max_model_len 9 a 6-token prompt's second step has room for one draft (vLLM keeps
    a position for the sampled token): 2 tokens scheduled, both emitted."""
    core = Engine(mtp_args(2, "1,1", max_model_len=9), record=True)
    submit(core, request("a", range(6), 3))
    results = passes(core, 2)
    assert [shares(r) for r in results] == [[("a", 0, 6)], [("a", 6, 2)]]
    assert [bursts(r) for r in results] == [{"a": 1}, {"a": 2}]
    assert core.is_empty()


def test_a_one_token_admission_beside_decodes_is_padded_with_placeholder_drafts() -> None:
    """vLLM pads a new request with one token to compute to the uniform decode shape when
    something else decodes: 1 + 2 tokens scheduled, the placeholders never accepted (even
    at an accept rate of 1), so it emits one token and its computed tokens come back to 1."""
    core = Engine(mtp_args(2, "1,1"), record=True)
    submit(core, request("a", range(4), 10))
    first = core.execute_pass(0.0)
    submit(core, request("b", [500], 2))
    second, third = passes(core, 2)
    assert shares(first) == [("a", 0, 4)]
    assert shares(second) == [("a", 4, 3), ("b", 0, 3)]
    assert bursts(second)["b"] == 1
    assert ("b", 1, 3) in shares(third)


def test_lookahead_hashes_store_a_block_once_the_token_after_it_is_known() -> None:
    """With prefix caching vLLM hashes each block with the token after it (extra keys
    `(None, token)`, published as `lookahead_token_ids`): of an 8-token prompt only block 0
    is stored at admission; block 1 once the first sampled token follows it, in the same
    pass, chained to block 0."""
    core = Engine(mtp_args(1, "1", enable_prefix_caching=True), record=True)
    submit(core, request("a", range(8), 3, output_token_ids=[100, 101, 102]))
    first, second = passes(core, 2)
    hasher = BlockHasher(DEFAULT_HASH_ALGO, none_hash(DEFAULT_HASH_ALGO, None))
    h0 = hasher.block_hash(None, [0, 1, 2, 3], (None, 4))
    h1 = hasher.block_hash(h0, [4, 5, 6, 7], (None, 100))
    stored = [e for e in first.kv_events if isinstance(e, BlockStored)]
    assert [(e.block_hashes, e.parent_hash, e.lookahead_token_ids) for e in stored] == [
        ([event_block_hash_int(h0)], None, [[4]]),
        ([event_block_hash_int(h1)], event_block_hash_int(h0), [[100]]),
    ]
    assert shares(second) == [("a", 8, 2)]
    assert bursts(second) == {"a": 2}
    assert not [e for e in second.kv_events if isinstance(e, BlockStored)]


def test_plain_hashes_store_full_blocks_at_once_as_a_draft_model_does() -> None:
    """`lookahead_block_hashes = false` (vLLM's draft_model method, or MTP with its two
    disable switches): the plain hashes, both prompt blocks stored at admission."""
    args = mtp_args(1, "1", enable_prefix_caching=True, lookahead_block_hashes=False)
    core = Engine(args, record=True)
    submit(core, request("a", range(8), 3, output_token_ids=[100, 101, 102]))
    (first,) = passes(core, 1)
    hasher = BlockHasher(DEFAULT_HASH_ALGO, none_hash(DEFAULT_HASH_ALGO, None))
    h0 = hasher.block_hash(None, [0, 1, 2, 3], None)
    h1 = hasher.block_hash(h0, [4, 5, 6, 7], None)
    stored = [e for e in first.kv_events if isinstance(e, BlockStored)]
    assert [(e.block_hashes, e.lookahead_token_ids) for e in stored] == [
        ([event_block_hash_int(h0), event_block_hash_int(h1)], None)
    ]


def test_the_trailing_block_drop_gives_a_prefix_hits_last_block_back() -> None:
    """vLLM's EAGLE trailing-block drop (`disable_lookahead_block_hashes` alone): a second
    12-token prompt finds its 2 full blocks (8 of its 11 hittable tokens) cached, drops the
    last and recomputes from token 4; without the drop it starts at 8."""
    for drop, hit in ((False, 8), (True, 4)):
        args = mtp_args(
            1, "1", enable_prefix_caching=True, lookahead_block_hashes=False, eagle_block_drop=drop
        )
        core = Engine(args, record=True)
        submit(core, request("a", range(12), 1))
        passes(core, 2)
        submit(core, request("b", range(12), 1))
        (admitted,) = passes(core, 1)
        assert shares(admitted) == [("b", hit, 12 - hit)]


def test_drafting_slots_take_input_budget_beside_each_scheduled_request() -> None:
    """vLLM's draft_model method gives each scheduled request one more input slot
    (`max_num_new_slots_for_drafting`): of a budget of 64, a 40-token prompt takes 41, so
    the next admission gets 64 - 41 - 1 = 22 tokens, not 24."""
    for slots, second in ((0, 24), (1, 22)):
        core = Engine(mtp_args(2, "1,1", num_gpu_blocks=64, drafting_slots=slots), record=True)
        submit(core, request("a", range(40), 3))
        submit(core, request("b", range(100, 140), 3))
        (first,) = passes(core, 1)
        assert shares(first) == [("a", 0, 40), ("b", 0, second)]


def test_async_scheduling_verifies_placeholder_drafts_a_batch_later() -> None:
    """vLLM's AsyncScheduler: a request that samples gets placeholders for its token and
    its drafts, and placeholder drafts for its next step, scheduled before the batch before
    resolves; a resolution rolls the rejected drafts back (nothing accepted here), and the
    step whose last token is already in flight is passed over."""
    core = Engine(mtp_args(2, "0,0", async_scheduling=True), record=True)
    submit(core, request("a", range(6), 3))
    results = passes(core, 4)
    assert [shares(r) for r in results] == [[("a", 0, 6)], [("a", 6, 3)], [("a", 9, 3)], []]
    assert [bursts(r) for r in results] == [{}, {"a": 1}, {"a": 1}, {"a": 1}]
    assert core.is_empty()


def test_a_budget_that_cannot_hold_a_token_and_its_lookahead_slots_is_refused() -> None:
    """vLLM's `VllmConfig` refuses it (a one-token admission padded to 1 + drafts could
    never be scheduled)."""
    with pytest.raises(InvalidArgsError) as refused:
        Engine(mtp_args(2, "1,1", max_num_batched_tokens=2))
    assert refused.value.key == "max_num_batched_tokens"
    assert str(refused.value) == (
        "VllmConfig does not have enough slots to schedule a token and support the "
        "speculative decoding settings. Got max_num_batched_tokens=2 and num_lookahead_tokens=2."
    )
    Engine(mtp_args(2, "1,1", max_num_batched_tokens=3))


def test_a_token_cap_that_cannot_hold_a_padded_admission_is_refused() -> None:
    """engined's own rule: vLLM accepts `--max-num-scheduled-tokens` at most the drafts, then
    holds a one-token admission, padded to 1 + drafts, at the head of its queue forever."""
    with pytest.raises(InvalidArgsError) as refused:
        Engine(mtp_args(1, "1", max_num_scheduled_tokens=1))
    assert refused.value.key == "max_num_scheduled_tokens"
    assert str(refused.value) == (
        "max_num_scheduled_tokens (1) must be greater than aic_nextn (1): an admission padded "
        "with its draft tokens could never be scheduled"
    )


def outputs_of(core: Engine, request_id: str) -> list[list[int]]:
    """Every output `request_id` got until the engine drained, each its tokens."""
    got: list[list[int]] = []
    now = 0.0
    while not core.is_empty():
        result = core.execute_pass(now)
        now = result.end_ms
        got += [o.new_token_ids for o in result.request_outputs() if o.request_id == request_id]
    return got


def test_a_requests_accepted_drafts_do_not_depend_on_its_batch() -> None:
    """Acceptance is drawn from the request's own stream (keyed as its tokens, and by
    `--mtp-seed`): beside another request, on another rank, it accepts the same drafts, so
    its outputs split its tokens alike; another `--mtp-seed` splits them otherwise."""

    def alone(worker_id: int = 0, **overrides: Any) -> list[list[int]]:
        core = Engine(mtp_args(2, "0.5,0.5", **overrides), dp_rank=worker_id, worker_id=worker_id)
        submit(core, request("a", range(8), 24))
        return outputs_of(core, "a")

    core = Engine(mtp_args(2, "0.5,0.5"))
    submit(core, request("b", range(100, 108), 24))
    submit(core, request("a", range(8), 24))
    beside = outputs_of(core, "a")
    assert beside == alone() == alone(worker_id=1)
    assert len(beside) < 24  # some drafts were accepted
    reseeded = alone(aic_mtp_seed=7)
    assert [t for out in reseeded for t in out] == [t for out in beside for t in out]
    assert [len(out) for out in reseeded] != [len(out) for out in beside]
