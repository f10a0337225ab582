"""Property: any workload drains to idle with a KV event stream a router accepts.

Random arrivals over random passes, prompts sharing prefixes, block sizes 2-64, tiny pools,
prefix caching on and off, MTP on and off, both preemption orders, both policies, both
prefix-hit rules, random vocabularies and, under vLLM semantics, vLLM's options that bound a
pass (long-prefill cap, watermark, max_num_active_seqs, prefill cadence, scheduled tokens)
and LoRA requests under `max_loras` (the running requests never use more adapters).
After the last arrival the core runs until empty; then no block may stay active and the
reference indexer must have seen no violation at all.
Every output keeps to its plan or its vocabulary, and no prefix hit exceeds what its rule
allows.
"""

from __future__ import annotations

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engined.core.args import EngineArgs, EngineType, PreemptionMode, PrefixHitRule, Semantics
from engined.core.engine import Engine
from engined.core.types import Cancel, EndedRequest, FinishReason, LoraRequest, Request
from tests.core.factories import (
    active_blocks,
    submit,
)
from tests.reference_indexer import ReferenceIndexer

# Adapters a workload draws from: two share a name at different paths.
ADAPTERS = [
    LoraRequest("a", 1, "/adapters/a"),
    LoraRequest("b", 2, "/adapters/b"),
    LoraRequest("c", 3, "/adapters/c"),
    LoraRequest("a", 4, "/adapters/a-v2"),
]


@st.composite
def workloads(draw: st.DrawFn, lora: bool = False) -> tuple[EngineArgs, list[tuple[int, Request]]]:
    """`lora`: vLLM semantics with LoRA on, always."""
    block_size = draw(st.sampled_from([2, 3, 4, 8, 16, 64]))
    num_blocks = draw(st.integers(3, 24))
    mtp = not lora and draw(st.booleans())
    engine = (
        EngineType.VLLM
        if lora
        else draw(st.sampled_from([EngineType.VLLM, EngineType.VLLM, EngineType.TRTLLM]))
    )
    vocab_size = draw(st.one_of(st.none(), st.integers(1, 6)))
    excluded = draw(st.lists(st.integers(0, (vocab_size or 6) - 1), max_size=4))
    if vocab_size is not None and len(set(excluded)) >= vocab_size:
        excluded = excluded[:0]
    args = EngineArgs(
        engine_type=engine,
        block_size=block_size,
        num_gpu_blocks=num_blocks,
        max_num_seqs=draw(st.integers(1, 6)),
        max_num_batched_tokens=draw(st.integers(1, 4 * block_size + 8)),
        enable_prefix_caching=draw(st.booleans()),
        enable_chunked_prefill=draw(st.booleans()),
        preemption_mode=draw(st.sampled_from(list(PreemptionMode))),
        aic_nextn=draw(st.integers(1, 3)) if mtp else None,
        aic_nextn_accept_rates=draw(st.sampled_from(["1,1,1", "0.5,0.5,0.5", "0,1"]))
        if mtp
        else None,
        speedup_ratio=0.0,
        seed=draw(st.integers(0, 3)),
        prefix_hit_rule=PrefixHitRule.VLLM if lora else draw(st.sampled_from(list(PrefixHitRule))),
        semantics=Semantics.VLLM if lora else draw(st.sampled_from(list(Semantics))),
        vocab_size=vocab_size,
        excluded_token_ids=tuple(excluded),
    )
    nextn, budget = args.aic_nextn, args.max_num_batched_tokens
    if args.runs_vllm_semantics() and nextn is not None and budget is not None and budget <= nextn:
        # vLLM refuses a budget that cannot hold a token and its lookahead slots.
        args = msgspec.structs.replace(args, max_num_batched_tokens=nextn + 1)
    if args.runs_vllm_semantics() and draw(st.booleans()):
        # vLLM's scheduler options that bound a pass (engined/core/paged/pass_limits.py).
        args = msgspec.structs.replace(
            args,
            long_prefill_token_threshold=draw(st.integers(0, 2 * block_size)),
            long_prefill_token_threshold_adaptive=draw(st.booleans()),
            watermark=draw(st.sampled_from([0.0, 0.1, 0.3])),
            max_num_active_seqs=draw(st.one_of(st.none(), st.integers(1, args.max_num_seqs or 1))),
            prefill_schedule_interval=draw(st.integers(1, 4)),
            # With MTP above the drafts: at most that, a padded admission never fits.
            max_num_scheduled_tokens=draw(
                st.one_of(st.none(), st.integers((nextn or 0) + 1, 4 * block_size + 4))
            ),
        )
    if lora or (args.runs_vllm_semantics() and draw(st.booleans())):
        args = msgspec.structs.replace(args, enable_lora=True, max_loras=draw(st.integers(1, 3)))
    alphabet = st.integers(0, 3)
    prefixes = draw(
        st.lists(st.lists(alphabet, min_size=1, max_size=3 * block_size), min_size=1, max_size=3)
    )
    arrivals = []
    for n in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes))
        tail = draw(st.lists(alphabet, max_size=2 * block_size))
        tokens = prefix + tail
        planned = draw(st.one_of(st.none(), st.lists(alphabet, max_size=6)))
        max_tokens = len(planned) if planned is not None else draw(st.integers(0, 6))
        at_pass = draw(st.integers(0, 8))
        adapter = (
            draw(st.one_of(st.none(), st.sampled_from(ADAPTERS))) if args.enable_lora else None
        )
        arrivals.append(
            (
                at_pass,
                Request(
                    token_ids=tokens,
                    max_tokens=max_tokens,
                    request_id=f"r{n}",
                    output_token_ids=planned,
                    lora_request=adapter,
                ),
            )
        )
    return args, sorted(arrivals, key=lambda a: a[0])


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_every_workload_drains_with_clean_events(
    workload: tuple[EngineArgs, list[tuple[int, Request]]],
) -> None:
    drains_with_clean_events(*workload)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads(lora=True))
def test_every_lora_workload_drains_with_clean_events(
    workload: tuple[EngineArgs, list[tuple[int, Request]]],
) -> None:
    drains_with_clean_events(*workload)


def drains_with_clean_events(args: EngineArgs, arrivals: list[tuple[int, Request]]) -> None:
    core = Engine(args)
    # vLLM's pool caches twins of a recomputed block; the mocker's never repeats a store.
    indexer = ReferenceIndexer(
        args.block_size,
        vllm=core.paged,
        lora_paths={lora.lora_int_id: lora.lora_path for lora in ADAPTERS},
    )
    expected_tokens: dict[str, int] = {}
    emitted: dict[str, int] = {}
    finished: set[str] = set()
    requests: dict[str, Request] = {}
    outputs: dict[str, list[int]] = {}
    recomputes = args.prefix_hit_rule is PrefixHitRule.VLLM and args.engine_type is EngineType.VLLM
    now = 0.0
    pass_no = 0
    pending = list(arrivals)
    while pending or not core.is_empty():
        while pending and pending[0][0] <= pass_no:
            request = pending.pop(0)[1]
            submit(core, request)
            requests[request.request_id or ""] = request
            max_tokens = request.max_tokens
            # Generation stops at the pool's capacity, vLLM's ceiling for max_model_len (its
            # null block holds no tokens), and without chunked prefill at one pass's budget.
            cap = core.usable_blocks * args.block_size
            if args.runs_vllm_semantics() and not args.enable_chunked_prefill:
                cap = min(cap, args.pass_token_budget or cap)
            if len(request.token_ids) < cap:
                max_tokens = min(max_tokens, cap - len(request.token_ids))
            expected_tokens[request.request_id or ""] = max_tokens
        result = core.execute_pass(now)
        assert result.end_ms >= now
        now = result.end_ms
        indexer.apply(result.kv_events)
        assert len({out.request_id for out in result.request_outputs()}) == len(
            result.request_outputs()
        )
        for out in result.request_outputs():
            assert out.request_id not in finished, "output after the last output"
            prompt_len = len(requests[out.request_id].token_ids)
            if out.cached_tokens is not None:
                assert out.cached_tokens % args.block_size == 0
                assert out.cached_tokens <= prompt_len
                if recomputes and expected_tokens[out.request_id] > 0:
                    assert out.cached_tokens < prompt_len, "vLLM's rule recomputes a token"
            if out.new_token_ids:
                emitted[out.request_id] = emitted.get(out.request_id, 0) + len(out.new_token_ids)
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                finished.add(out.request_id)
                produced = emitted.get(out.request_id, 0)
                if out.finish_reason is FinishReason.REJECTED:
                    assert produced == 0
                else:
                    assert produced == expected_tokens[out.request_id]
        assert {e.request_id for e in result.ended} == {
            out.request_id for out in result.request_outputs() if out.finish_reason is not None
        }
        if args.enable_lora:
            running = [requests[r].lora_request for r in core.queues().running]
            assert len({lora.lora_int_id for lora in running if lora}) <= args.max_loras
        pass_no += 1
        if pass_no == 2000:
            break
    if not core.is_empty():
        # NOTE: only FIFO preemption may fail to drain: evicting the oldest running request
        # can evict the very request that needed the block, and two requests then take turns
        # preempting each other forever. Upstream behaves the same (see README, limits).
        # Cancelling what is left must still free everything.
        assert args.preemption_mode is PreemptionMode.FIFO, "workload did not drain"
        assert not pending
        queues = core.queues()
        for request_id in queues.waiting + queues.running:
            effects = core.apply(Cancel(request_id), now_ms=now)
            assert effects.ended == [EndedRequest(request_id, FinishReason.CANCELLED)]
            finished.add(request_id)
    indexer.assert_clean()
    for request_id, tokens in outputs.items():
        planned = requests[request_id].output_token_ids
        if planned is not None:
            assert tokens == planned[: len(tokens)], "planned outputs are emitted as given"
        else:
            assert not set(tokens) & set(args.excluded_token_ids)
            assert args.vocab_size is None or max(tokens) < args.vocab_size
    assert finished == set(expected_tokens)
    assert active_blocks(core) == 0
    assert core.metrics().running == 0 and core.metrics().waiting == 0
    if not args.enable_prefix_caching:
        assert indexer.ok_count("stored") == 0
