"""The prefix-hit rule: vLLM's (default) recomputes the last block of a fully cached prompt.

Each case warms the cache with one request, drains it, repeats the prompt and reads every
output the rule reaches: the first signal's `cached_tokens`, the admission's reused tokens,
the pass's prefix-cache counters, its FPM and its KV events (none: the recomputed block is
resident, so it is reused, not allocated or stored again).
"""

from __future__ import annotations

from typing import Any

import pytest

from engined.core.args import EngineArgs, EngineType, PreemptionMode, PrefixHitRule, WorkerType
from engined.core.engine import Engine
from engined.core.errors import InvalidArgsError
from engined.core.types import (
    ActivateDestination,
    DestinationReserved,
    PassResult,
    ReserveDestination,
)
from tests.core.factories import (
    active_blocks,
    make_args,
    make_core,
    request,
    run_until_empty,
    submit,
)
from tests.reference_indexer import ReferenceIndexer

VLLM = PrefixHitRule.VLLM
MOCKER = PrefixHitRule.MOCKER_1_3_0


def cache_args(rule: PrefixHitRule, **overrides: Any) -> EngineArgs:
    """bs 16, room for any prompt here twice over, a budget that prefills it in one pass."""
    fields: dict[str, Any] = {
        "block_size": 16,
        "num_gpu_blocks": 64,
        "max_num_batched_tokens": 1024,
        "enable_prefix_caching": True,
        "prefix_hit_rule": rule,
    }
    fields.update(overrides)
    return make_args(**fields)


class Watched:
    def __init__(self, core: Engine) -> None:
        self.core = core
        self.indexer = ReferenceIndexer(core.block_size)

    def run(self, now_ms: float = 0.0) -> list[PassResult]:
        passes = run_until_empty(self.core, now_ms)
        for result in passes:
            self.indexer.apply(result.kv_events)
        return passes


def repeat(args: EngineArgs, prompt_len: int, max_tokens: int = 2) -> tuple[Watched, PassResult]:
    """Warm, drain, then run the repeat's admission pass; returns it."""
    watched = Watched(make_core(args))
    prompt = list(range(1000, 1000 + prompt_len))
    submit(watched.core, request("warm", prompt, max_tokens))
    watched.run()
    submit(watched.core, request("again", prompt, max_tokens))
    first = watched.core.execute_pass(1e6)
    watched.indexer.apply(first.kv_events)
    watched.run(1e6)
    watched.indexer.assert_clean()
    return watched, first


CASES = [(128, 112), (129, 128), (100, 96), (16, 0), (17, 16), (15, 0), (32, 16)]


@pytest.mark.parametrize(("prompt_len", "cached"), CASES)
def test_vllm_rule_caps_the_hit_one_token_short(prompt_len: int, cached: int) -> None:
    watched, first = repeat(cache_args(VLLM), prompt_len)
    assert first.admissions[0].reused_input_tokens == cached
    assert first.request_outputs()[0].cached_tokens == cached
    assert (first.prefix_cache_queries, first.prefix_cache_hits) == (prompt_len, cached)
    fpm = first.fpm
    assert (fpm.num_prefill_requests, fpm.num_decode_requests) == (1, 0)
    assert (fpm.sum_prefill_tokens, fpm.sum_prefill_kv_tokens) == (prompt_len - cached, cached)
    assert first.kv_events == [], "the recomputed block is reused, never stored again"
    assert active_blocks(watched.core) == 0


@pytest.mark.parametrize(("prompt_len", "vllm_cached"), CASES)
def test_mocker_rule_counts_every_cached_block(prompt_len: int, vllm_cached: int) -> None:
    cached = prompt_len // 16 * 16
    _, first = repeat(cache_args(MOCKER), prompt_len)
    assert first.admissions[0].reused_input_tokens == cached
    assert first.request_outputs()[0].cached_tokens == cached
    assert first.prefix_cache_hits == cached
    fpm = first.fpm
    if cached == prompt_len:
        # Nothing to compute: the request is scheduled as a decode (1.3.0's FPM quirk).
        assert (fpm.num_prefill_requests, fpm.num_decode_requests) == (0, 1)
        assert fpm.sum_prefill_tokens == 0
    else:
        assert (fpm.sum_prefill_tokens, fpm.sum_prefill_kv_tokens) == (prompt_len - cached, cached)
    assert first.kv_events == []


def test_the_rules_differ_only_for_fully_cached_prompts() -> None:
    for prompt_len, vllm_cached in CASES:
        mocker_cached = prompt_len // 16 * 16
        assert (vllm_cached == mocker_cached) == (prompt_len % 16 != 0)


def test_both_rules_take_the_same_blocks_and_publish_the_same_events() -> None:
    streams = []
    for rule in (VLLM, MOCKER):
        watched = Watched(make_core(cache_args(rule)))
        for n in range(3):
            submit(watched.core, request(f"r{n}", range(64), 3))
        passes = watched.run()
        watched.indexer.assert_clean()
        streams.append([event for result in passes for event in result.kv_events])
    assert streams[0] == streams[1]


def test_repeat_while_the_first_holds_its_blocks_reuses_them() -> None:
    """The hit is active: the repeat needs no new full block, only its new partial."""
    core = make_core(cache_args(VLLM))
    submit(core, request("a", range(64), 10))
    core.execute_pass(0.0)
    active = active_blocks(core)
    submit(core, request("b", range(64), 10))
    second = core.execute_pass(1.0)
    assert second.admissions[0].reused_input_tokens == 48
    assert second.kv_events == []
    assert active_blocks(core) == active + 1


def test_active_recomputed_block_is_not_discounted_by_the_gate() -> None:
    """Upstream's gate: the capped hit's active part is what the request need not find.

    bs 4, 3 blocks: the holder's 8-token prompt and its first output fill the pool. A repeat
    of that prompt needs 0 more blocks under 1.3.0 (8 active cached tokens) and 1 under
    vLLM's rule (only 4 count), so vLLM makes it wait for the holder.
    """
    admitted = {}
    for rule in (VLLM, MOCKER):
        core = make_core(
            make_args(
                num_gpu_blocks=3,
                max_num_batched_tokens=16,
                enable_prefix_caching=True,
                prefix_hit_rule=rule,
            )
        )
        submit(core, request("holder", range(8), 3))
        core.execute_pass(0.0)
        submit(core, request("repeat", range(8), 1))
        admitted[rule] = [a.request_id for a in core.execute_pass(1.0).admissions]
        run_until_empty(core, 2.0)
        assert active_blocks(core) == 0
    assert admitted == {VLLM: [], MOCKER: ["repeat"]}


@pytest.mark.parametrize(("prompt_len", "cached"), [(128, 96), (129, 112), (20, 0), (40, 16)])
def test_mtp_drops_one_more_block(prompt_len: int, cached: int) -> None:
    args = cache_args(VLLM, aic_nextn=1, aic_nextn_accept_rates="1")
    _, first = repeat(args, prompt_len)
    assert first.admissions[0].reused_input_tokens == cached
    assert first.request_outputs()[0].cached_tokens == cached


def test_mtp_keeps_the_full_hit_under_mocker_rule() -> None:
    args = cache_args(MOCKER, aic_nextn=1, aic_nextn_accept_rates="1")
    assert repeat(args, 128)[1].request_outputs()[0].cached_tokens == 128


def test_zero_output_needs_no_logits_so_keeps_the_full_hit() -> None:
    _, first = repeat(cache_args(VLLM), 128, max_tokens=0)
    assert first.request_outputs()[0].cached_tokens == 128
    assert (
        first.request_outputs()[0].finish_reason is not None
        and first.request_outputs()[0].new_token_ids == []
    )


def test_trtllm_keeps_the_full_hit() -> None:
    _, first = repeat(cache_args(VLLM, engine_type=EngineType.TRTLLM), 128)
    assert first.request_outputs()[0].cached_tokens == 128


def test_preempted_request_finds_its_generated_blocks_under_vllm_rule() -> None:
    """Re-admission looks up the whole known sequence, as vLLM's `num_tokens - 1` does.

    bs 4, 6 blocks, LIFO: two 4-token prompts with 9 outputs decode until the pool is full
    and the newer one is preempted once. The block it generated stays cached, so at
    re-admission vLLM's rule reuses 8 tokens; 1.3.0 stops at the 4-token prompt.
    """
    reused = {}
    for rule in (VLLM, MOCKER):
        core = make_core(
            make_args(
                num_gpu_blocks=6,
                max_num_batched_tokens=16,
                enable_prefix_caching=True,
                prefix_hit_rule=rule,
            )
        )
        submit(core, request("old", [1, 2, 3, 4], 9))
        submit(core, request("new", [100, 101, 102, 103], 9))
        passes = run_until_empty(core)
        assert active_blocks(core) == 0
        reused[rule] = [a.reused_input_tokens for p in passes for a in p.admissions][2:]
    assert reused == {VLLM: [8], MOCKER: [4]}


def test_fifo_ping_pong_case_drains_under_vllm_rule() -> None:
    """The FIFO ping-pong twin (test_core_behavior) pins 1.3.0's rule; here is vLLM's.

    The victim re-admitted finds the blocks it generated, so it recomputes less and needs no
    block the other holds: one preemption, and the three requests finish in 15 passes.
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
        )
    )
    submit(core, request("long", [0] * 15, 4, output_token_ids=[0] * 4))
    submit(core, request("short", [0] * 2, 2))
    submit(core, request("single", [0] * 9, 1, output_token_ids=[0]))
    passes = run_until_empty(core)
    assert (len(passes), passes[-1].metrics.preemptions_total) == (15, 1)
    assert active_blocks(core) == 0


# --- destinations -------------------------------------------------------------------------------


def destination_reserved(rule: PrefixHitRule, prompt_len: int) -> tuple[int, Watched]:
    """A decode worker with the prompt cached, then a destination for the same prompt."""
    args = make_args(
        num_gpu_blocks=12,
        max_num_batched_tokens=16,
        max_num_seqs=2,
        enable_prefix_caching=True,
        worker_type=WorkerType.DECODE,
        prefix_hit_rule=rule,
    )
    watched = Watched(make_core(args))
    core = watched.core
    prompt = list(range(prompt_len))
    submit(core, request("warm", prompt, 1))
    watched.run()
    effects = core.apply(ReserveDestination("h", request("dest", prompt, 2)), now_ms=0.0)
    watched.indexer.apply(effects.kv_events)
    assert effects.kv_events == [], "the reservation publishes nothing"
    reserved = [e for e in effects.lifecycle_events if isinstance(e, DestinationReserved)]
    assert len(reserved) == 1
    return reserved[0].transferable_prompt_tokens, watched


@pytest.mark.parametrize(
    ("rule", "prompt_len", "transferable"),
    [(VLLM, 8, 4), (MOCKER, 8, 0), (VLLM, 9, 4), (MOCKER, 9, 4), (VLLM, 4, 4), (MOCKER, 4, 0)],
)
def test_destination_transfers_what_the_hit_leaves(
    rule: PrefixHitRule, prompt_len: int, transferable: int
) -> None:
    """vLLM's decode side asks the connector for every token after its capped local hit."""
    tokens, watched = destination_reserved(rule, prompt_len)
    assert tokens == transferable
    core = watched.core
    activated = core.apply(ActivateDestination("h"), now_ms=0.0)
    assert activated.result is not None
    activation = activated.kv_events
    watched.indexer.apply(activation)
    assert activation == [], "the transferred block is resident: no second Stored"
    passes = watched.run(1e6)
    first = next(out for p in passes for out in p.request_outputs() if out.request_id == "dest")
    assert first.cached_tokens == 0, "a prebuilt prompt came by transfer, under either rule"
    watched.indexer.assert_clean()
    assert active_blocks(core) == 0


# --- EngineArgs ---------------------------------------------------------------------------------


def test_args_default_to_vllms_rule_and_load_either() -> None:
    assert EngineArgs.from_mapping({}).prefix_hit_rule is VLLM
    assert EngineArgs.from_mapping({"prefix_hit_rule": "MOCKER-1.3.0"}).prefix_hit_rule is MOCKER


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("full", "Invalid prefix_hit_rule 'full'. Must be 'vllm' or 'mocker-1.3.0'."),
        (None, "prefix_hit_rule must not be null"),
        (1, "Expected `str`, got `int` - at `$.prefix_hit_rule`"),
    ],
)
def test_args_refuse_unknown_rules(value: object, message: str) -> None:
    with pytest.raises(InvalidArgsError) as info:
        EngineArgs.from_mapping({"prefix_hit_rule": value})
    assert str(info.value) == message
