"""The hand-inlined decode steps change nothing: with them forced off, every result is equal.

`Scheduler._schedule_running` and `TokenEmitter.emit` each inline the common decode step
(one dangling token inside an allocated block; a token that neither opens a block nor ends
the request) for speed. `Engine(..., fast_paths=False)` sends every request through the
general path instead. Random workloads (preemption, MTP bursts, planned outputs, a
vocabulary, prefix caching on and off, destinations, offload tiers, cancels) are run on both
engines with the same commands at the same times; every `CommandEffects` and `PassResult`
must be equal, field by field, and so must the final gauges. Under vLLM semantics the paged
scheduler also samples plain decode steps where it schedules them (off with the fast paths):
`vllm_workloads` checks that against the unfused walk, including the policies that turn it
off (priority scheduling, FIFO preemption) and pools small enough to preempt.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engined.core.args import EngineArgs, PreemptionMode, SchedulingPolicy, WorkerType
from engined.core.args_fields import Semantics
from engined.core.engine import Engine
from engined.core.errors import CoreError
from engined.core.types import (
    ActivateDestination,
    Cancel,
    Command,
    CommandEffects,
    EngineMetrics,
    PassResult,
    Request,
    ReserveDestination,
    Submit,
)
from tests.core.factories import make_args

PROMPTS = [list(range(100, 100 + n)) for n in (3, 8, 13, 21, 40)]


@st.composite
def workloads(draw: st.DrawFn) -> tuple[EngineArgs, list[tuple[str, int, int]]]:
    fields: dict[str, Any] = {
        "block_size": draw(st.sampled_from([2, 4, 16])),
        "num_gpu_blocks": draw(st.integers(6, 40)),
        "max_num_batched_tokens": draw(st.integers(4, 64)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "enable_prefix_caching": draw(st.booleans()),
        "preemption_mode": draw(st.sampled_from(list(PreemptionMode))),
        "worker_type": draw(st.sampled_from([WorkerType.AGGREGATED, WorkerType.DECODE])),
        "vocab_size": draw(st.sampled_from([None, 50])),
        "seed": draw(st.integers(0, 3)),
    }
    if draw(st.booleans()):
        fields |= {"aic_nextn": 2, "aic_nextn_accept_rates": "0.7,0.4"}
    if draw(st.booleans()):
        fields |= {
            "enable_prefix_caching": True,
            "num_g2_blocks": draw(st.integers(2, 16)),
            "kv_bytes_per_token": 50_000,
            "bandwidth_g1_to_g2_gbps": 1.0,
            "bandwidth_g2_to_g1_gbps": 1.0,
        }
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["submit", "submit", "planned", "cancel", "reserve", "pass"]),
                st.integers(0, 7),
                st.integers(0, len(PROMPTS) - 1),
            ),
            min_size=1,
            max_size=40,
        )
    )
    return make_args(**fields), ops


@st.composite
def vllm_workloads(draw: st.DrawFn) -> tuple[EngineArgs, list[tuple[str, int, int]]]:
    fields: dict[str, Any] = {
        "semantics": Semantics.VLLM,
        "block_size": draw(st.sampled_from([2, 4, 16])),
        "num_gpu_blocks": draw(st.integers(6, 40)),
        "max_num_batched_tokens": draw(st.integers(4, 64)),
        "max_num_seqs": draw(st.integers(1, 6)),
        "enable_prefix_caching": draw(st.booleans()),
        "preemption_mode": draw(st.sampled_from(list(PreemptionMode))),
        "scheduling_policy": draw(st.sampled_from(list(SchedulingPolicy))),
        "worker_type": draw(st.sampled_from([WorkerType.AGGREGATED, WorkerType.DECODE])),
        "vocab_size": draw(st.sampled_from([None, 50])),
        "seed": draw(st.integers(0, 3)),
    }
    ops = draw(
        st.lists(
            st.tuples(
                st.sampled_from(
                    ["submit", "submit", "stop", "planned", "cancel", "reserve", "pass"]
                ),
                st.integers(0, 7),
                st.integers(0, len(PROMPTS) - 1),
            ),
            min_size=1,
            max_size=40,
        )
    )
    return make_args(**fields), ops


def command_of(op: str, n: int, prompt: int) -> Command | None:
    tokens = [*PROMPTS[prompt], n]
    match op:
        case "submit":
            return Submit(Request(token_ids=tokens, max_tokens=3 + 5 * n, request_id=f"r{n}"))
        case "planned":
            planned = [7 * n + i for i in range(2 + n)]
            request = Request(
                token_ids=tokens, max_tokens=0, request_id=f"p{n}", output_token_ids=planned
            )
            return Submit(request)
        case "stop":
            # A vocabulary of 50 draws ids below 50: 3 and 17 stop some of them early.
            request = Request(
                token_ids=tokens, max_tokens=4 + 6 * n, request_id=f"s{n}", stop_token_ids=[3, 17]
            )
            return Submit(request)
        case "cancel":
            return Cancel(f"r{n}")
        case "reserve":
            request = Request(token_ids=tokens, max_tokens=2 + n, request_id=f"d{n}")
            return ReserveDestination(f"h{n}", request)
    return None


def apply(engine: Engine, command: Command, now: float) -> CommandEffects | str:
    try:
        return engine.apply(command, now_ms=now)
    except CoreError as error:
        return f"{type(error).__name__}: {error}"


def run(engine: Engine, ops: list[tuple[str, int, int]]) -> list[object]:
    """Everything the engine returned, in order, then its final gauges."""
    record: list[object] = []
    now = 0.0

    def step() -> PassResult:
        nonlocal now
        result = engine.execute_pass(now)
        now = max(now + 1.0, result.end_ms)
        record.append(result)
        for event in result.lifecycle_events:
            with contextlib.suppress(CoreError):
                record.append(apply(engine, ActivateDestination(event.handoff_id), now))
        return result

    for op, n, prompt in ops:
        command = command_of(op, n, prompt)
        if command is None:
            step()
        else:
            record.append(apply(engine, command, now))
    for _ in range(400):
        if engine.is_empty() and engine.next_deadline() is None:
            break
        step()
    record.append(engine.metrics())
    return record


def assert_fast_equals_slow(args: EngineArgs, ops: list[tuple[str, int, int]]) -> None:
    """The engine with and without its hand-inlined paths gives equal results, one by one."""
    fast = run(Engine(args), ops)
    slow = run(Engine(args, fast_paths=False), ops)
    assert len(fast) == len(slow)
    for index, (a, b) in enumerate(zip(fast, slow, strict=True)):
        assert a == b, f"result {index} differs"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_inlined_decode_steps_give_identical_results(
    workload: tuple[EngineArgs, list[tuple[str, int, int]]],
) -> None:
    assert_fast_equals_slow(*workload)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(vllm_workloads())
def test_fused_decode_sampling_gives_identical_results(
    workload: tuple[EngineArgs, list[tuple[str, int, int]]],
) -> None:
    assert_fast_equals_slow(*workload)


def test_a_long_vllm_decode_workload_is_identical() -> None:
    """The benchmark's shape under vLLM semantics, at a small scale, with a pool small enough
    that decoding evicts and preempts: fused and unfused walks give the same results."""
    args = make_args(
        semantics=Semantics.VLLM,
        block_size=4,
        num_gpu_blocks=120,
        max_num_seqs=16,
        max_num_batched_tokens=256,
        enable_prefix_caching=True,
    )

    def engine_with_requests(fast_paths: bool) -> Engine:
        engine = Engine(args, fast_paths=fast_paths)
        for n in range(48):
            tokens = PROMPTS[n % len(PROMPTS)] + [n] * 9
            request = Request(token_ids=tokens, max_tokens=24 + n % 7, request_id=f"r{n}")
            engine.apply(Submit(request), now_ms=0.0)
        return engine

    fast = run(engine_with_requests(True), [])
    slow = run(engine_with_requests(False), [])
    assert fast == slow
    passes = [r for r in fast if isinstance(r, PassResult)]
    assert sum(len(r.decodes.request_ids) >= 8 for r in passes) > 20
    metrics = fast[-1]
    assert isinstance(metrics, EngineMetrics)
    assert metrics.preemptions_total > 0


def test_a_long_decode_workload_is_identical() -> None:
    """The benchmark's shape at a small scale: 64 requests, shared prefixes, 64 outputs."""
    args = make_args(
        block_size=16,
        num_gpu_blocks=256,
        max_num_seqs=32,
        max_num_batched_tokens=2048,
        enable_prefix_caching=True,
    )

    def engine_with_requests(fast_paths: bool) -> Engine:
        engine = Engine(args, fast_paths=fast_paths)
        for n in range(64):
            tokens = PROMPTS[n % len(PROMPTS)] + [n] * 20
            request = Request(token_ids=tokens, max_tokens=64, request_id=f"r{n}")
            engine.apply(Submit(request), now_ms=0.0)
        return engine

    fast = run(engine_with_requests(True), [])
    slow = run(engine_with_requests(False), [])
    assert fast == slow
    assert sum(isinstance(r, PassResult) and len(r.request_outputs()) >= 32 for r in fast) > 50
