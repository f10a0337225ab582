"""FPM's queued-request figures come from tallies, not from a walk of the queues (issue 10, 7).

1. A pass never iterates the waiting queue, however deep it is: with 20,000 requests waiting
   behind a full running set, passes run without one iteration of it.
2. Property: after every command and pass of random workloads (preemption, cancels, offload
   tiers, P/D destinations at every stage), the tallies equal what walking the queues gives,
   the walk the core used to do each pass, and the variance is the exact one correctly
   rounded (`statistics.pvariance`, computed in fractions).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engined.core.args import EngineArgs, EngineType, WorkerType
from engined.core.engine import Engine
from engined.core.state import RequestState, RequestStatus
from engined.core.types import (
    Request,
)
from tests.core.factories import submit, tiered_args
from tests.core.pd_workload import drive, settle, steps


class CountingRequests(dict[str, RequestState]):
    """The request table, counting every record read (a queue walk reads one per request)."""

    reads = 0

    def __getitem__(self, key: str) -> RequestState:
        CountingRequests.reads += 1
        return super().__getitem__(key)

    def get(self, key: str, default: Any = None) -> Any:
        CountingRequests.reads += 1
        return super().get(key, default)

    def values(self) -> Any:
        CountingRequests.reads += len(self)
        return super().values()

    def items(self) -> Any:
        CountingRequests.reads += len(self)
        return super().items()

    def __iter__(self) -> Iterator[str]:
        CountingRequests.reads += len(self)
        return super().__iter__()


def test_a_pass_does_not_walk_a_deep_waiting_queue() -> None:
    """50 passes over 20,000 waiting requests read a bounded number of records per pass
    (the 4 running ones and the admission's), not one per waiting request."""
    core = Engine(EngineArgs(block_size=16, num_gpu_blocks=4096, max_num_seqs=4, speedup_ratio=0.0))
    state = core.parts.state
    state.requests = CountingRequests(state.requests)
    for i in range(20_000):
        submit(core, Request(token_ids=[i, i + 1], max_tokens=1_000, request_id=f"r{i}"))
    CountingRequests.reads = 0
    now = 0.0
    for _ in range(50):
        result = core.execute_pass(now)
        now = result.end_ms
    assert CountingRequests.reads <= 50 * 16, CountingRequests.reads
    assert result.fpm.num_queued_prefill == 20_000 - 4
    assert result.fpm.sum_queued_prefill_tokens == 2 * (20_000 - 4)


def walked(core: Engine) -> tuple[list[int], list[int]]:
    """Queued prefill and decode lengths, by walking the queues as the core used to."""
    parts = core.parts
    requests = parts.state.requests
    active = parts.book.active.by_request
    prefill: list[int] = []
    decode: list[int] = []
    for request_id in parts.state.waiting:
        req = requests[request_id]
        if request_id in active:
            decode.append(req.seq.num_input_tokens)
        elif req.status is RequestStatus.WAITING:
            prefill.append(req.seq.num_input_tokens)
        elif req.status is RequestStatus.PREEMPTED:
            decode.append(len(req.seq.tokens))
    decode += [p.request.seq.num_input_tokens for p in parts.book.pending.queue.values()]
    decode += [h.request.seq.num_input_tokens for h in parts.book.held.by_handoff.values()]
    return prefill, decode


def exact(lengths: list[int]) -> tuple[int, int, float]:
    n, total = len(lengths), sum(lengths)
    if n == 0:
        return 0, 0, 0.0
    return n, total, (n * sum(x * x for x in lengths) - total * total) / (n * n)


def check(core: Engine) -> None:
    queued = core.parts.queued
    for tally, lengths in zip((queued.prefill, queued.decode), walked(core), strict=True):
        summary = tally.summary()
        assert summary == exact(lengths)
        if lengths:
            assert summary.variance == statistics.pvariance(lengths)


@st.composite
def workloads(draw: st.DrawFn) -> tuple[EngineArgs, list[tuple[str, int, int]]]:
    tiers = draw(st.booleans())
    args: dict[str, Any] = {
        "block_size": 4,
        "num_gpu_blocks": draw(st.integers(6, 12)),
        "max_num_batched_tokens": draw(st.integers(4, 16)),
        "max_num_seqs": draw(st.integers(1, 4)),
        "enable_prefix_caching": draw(st.booleans()),
        "engine_type": draw(st.sampled_from([EngineType.VLLM, EngineType.TRTLLM])),
        "worker_type": draw(st.sampled_from([WorkerType.AGGREGATED, WorkerType.DECODE])),
        "speedup_ratio": 0.0,
    }
    if tiers:
        args |= {
            "enable_prefix_caching": True,
            "num_g2_blocks": draw(st.integers(2, 8)),
            "kv_bytes_per_token": draw(st.sampled_from([50_000, 500_000])),
            "bandwidth_g1_to_g2_gbps": 1.0,
            "bandwidth_g2_to_g1_gbps": 1.0,
        }
    ops = draw(steps(["submit", "cancel", "reserve", "activate", "drop", "pass", "pass", "wait"]))
    return EngineArgs(**args), ops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_tallies_equal_the_walk_after_every_step(
    workload: tuple[EngineArgs, list[tuple[str, int, int]]],
) -> None:
    args, ops = workload
    core = Engine(args)
    settle(core, drive(core, ops, lambda: check(core)), lambda: check(core))
    queued = core.parts.queued
    assert queued.prefill.summary() == queued.decode.summary() == (0, 0, 0.0)


def test_tallies_follow_a_parked_onboard() -> None:
    """A request whose prefix only G2 holds leaves the queue while it is onboarded and comes
    back at its front; the tallies follow it out and in."""
    core = Engine(tiered_args(num_gpu_blocks=2, num_g2_blocks=4))
    now = 0.0
    parked = 0
    # A's block is cached, evicted to G2 by B and C, and then A's prefix comes back.
    for i, tokens in enumerate([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12], [1, 2, 3, 4, 99]]):
        submit(core, Request(token_ids=tokens, max_tokens=1, request_id=f"r{i}"))
        check(core)
        for _ in range(20):
            now = max(core.execute_pass(now).end_ms, now + 0.5)
            check(core)
            parked = max(parked, len(core.queues().parked))
    assert parked == 1
    assert core.is_drained()
