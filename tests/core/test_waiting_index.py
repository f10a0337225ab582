"""The waiting queue's prebuilt index: exact on every path, and no walk of the queue per pass.

On a decode engine with a destination pending, a pass admits only prebuilt (activated)
requests, the first in queue order. The core used to find it by walking the waiting queue,
O(waiting) per pass; the state now keeps the prebuilt ones in queue order beside the queue.

1. Property: after every command and pass of random P/D destination workloads (activations,
   cancels at every stage, preemption in a small pool, parking with offload tiers), the
   prebuilt head equals what the old walk finds and the plain head is the FIFO head.
2. Each path into and out of the queue on a bare state (and on the tallied one the engine
   uses): appends, a prepended prebuilt request, removal mid-queue, a re-used id.
3. A pass on a decode engine with 20,000 requests waiting behind a pending destination looks
   at none of them.
"""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engined.core.args import EngineArgs, PrefixHitRule, WorkerType
from engined.core.engine import Engine
from engined.core.queued import TalliedState
from engined.core.sequence import Sequence
from engined.core.state import RequestState, RequestStatus, SchedulerState
from engined.core.types import (
    ActivateDestination,
    Command,
    Request,
    ReserveDestination,
    Submit,
)
from tests.core.factories import tiered_args
from tests.core.pd_workload import drive, settle, steps

# Three families sharing their first blocks: a small G1 evicts them to G2 and onboards them.
PROMPTS = [list(range(base, base + n)) for base in (100, 300, 500) for n in (3, 8, 17)]


def walked_prebuilt(state: SchedulerState) -> str | None:
    """The first prebuilt waiting request, found as the core used to: by walking the queue."""
    for request_id in state.waiting:
        if state.requests[request_id].prompt_is_prebuilt():
            return request_id
    return None


def check(state: SchedulerState) -> None:
    order = list(state.waiting)
    assert len(state.waiting) == len(order) == len(set(order))
    assert state.next_waiting(True) == walked_prebuilt(state)
    assert state.next_waiting(False) == (order[0] if order else None)


DESTINATION_HEAVY = [
    *["reserve", "activate", "activate", "drop"],
    *["submit", "submit", "cancel", "cancel"],
    *["pass", "pass", "wait"],
]
REQUEST_HEAVY = [
    *["reserve", "activate", "drop"],
    *["submit"] * 4,
    *["cancel", "pass", "pass", "pass", "wait", "wait"],
]


@st.composite
def workloads(draw: st.DrawFn) -> tuple[EngineArgs, list[tuple[str, int, int]]]:
    args: dict[str, Any] = {
        "block_size": 4,
        "num_gpu_blocks": draw(st.integers(6, 14)),
        "max_num_batched_tokens": draw(st.integers(4, 16)),
        "max_num_seqs": draw(st.integers(1, 3)),
        "enable_prefix_caching": draw(st.booleans()),
        "worker_type": draw(st.sampled_from([WorkerType.DECODE, WorkerType.AGGREGATED])),
        "prefix_hit_rule": draw(st.sampled_from(list(PrefixHitRule))),
        "speedup_ratio": 0.0,
    }
    if draw(st.booleans()):
        args |= {
            "enable_prefix_caching": True,
            "num_gpu_blocks": draw(st.integers(6, 8)),
            "num_g2_blocks": draw(st.integers(4, 16)),
            "kv_bytes_per_token": draw(st.sampled_from([50_000, 500_000])),
            "bandwidth_g1_to_g2_gbps": 1.0,
            "bandwidth_g2_to_g1_gbps": 1.0,
        }
    # Destination-heavy workloads keep a destination pending (only prebuilt requests are
    # admitted); request-heavy ones admit fresh requests, which is when they get parked.
    mix = draw(st.sampled_from([DESTINATION_HEAVY, REQUEST_HEAVY]))
    ops = draw(steps(mix, prompts=len(PROMPTS), max_size=80))
    return EngineArgs(**args), ops


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_the_index_equals_the_walk_after_every_step(
    workload: tuple[EngineArgs, list[tuple[str, int, int]]],
) -> None:
    args, ops = workload
    core = Engine(args)
    state = core.parts.state
    now = drive(
        core,
        ops,
        lambda: check(state),
        prompts=PROMPTS,
        destination_max_tokens=lambda n: 2 * n + 1,
        cancelled=lambda n: f"r{n}" if n % 2 else f"d{n}",
        min_pass_ms=0.25,
    )
    settle(core, now, lambda: check(state))
    assert state.next_waiting(True) is None and state.next_waiting(False) is None


def test_a_landed_onboard_heads_the_queue_while_a_destination_is_admitted() -> None:
    """A parked request comes back to the front while a destination is pending: it waits
    there, and the activated destination behind it is admitted past it."""
    core = Engine(tiered_args(num_gpu_blocks=6, num_g2_blocks=8))
    state = core.parts.state
    now = 0.0

    def step() -> None:
        nonlocal now
        now = max(core.execute_pass(now).end_ms, now + 0.5)
        check(state)

    def apply(command: Command) -> None:
        core.apply(command, now_ms=now)
        check(state)

    # The first prompt's blocks are cached, then evicted to G2 by the other three.
    for i, base in enumerate([10, 20, 30, 70]):
        apply(
            Submit(Request(token_ids=list(range(base, base + 8)), max_tokens=1, request_id=f"c{i}"))
        )
        for _ in range(10):
            step()
    apply(Submit(Request(token_ids=[40, 41, 42, 43], max_tokens=1_000, request_id="long")))
    step()
    apply(Submit(Request(token_ids=[*range(10, 18), 99], max_tokens=2, request_id="cold")))
    for _ in range(10):
        if core.queues().parked:
            break
        step()
    assert core.queues().parked == ["cold"]
    apply(Submit(Request(token_ids=[44], max_tokens=1_000, request_id="long2")))
    apply(ReserveDestination("h1", Request(token_ids=[50, 51, 52], max_tokens=2, request_id="d1")))
    apply(
        ReserveDestination(
            "h2", Request(token_ids=list(range(60, 80)), max_tokens=2, request_id="d2")
        )
    )
    for _ in range(20):
        if "h1" in core.parts.book.held.by_handoff:
            break
        step()
    assert list(state.waiting) == ["cold", "long2"] and core.queues().parked == []
    apply(ActivateDestination("h1"))
    assert list(state.waiting) == ["cold", "long2", "d1"]
    assert state.next_waiting(True) == "d1" and state.next_waiting(False) == "cold"
    step()
    assert "d1" in core.queues().running and list(state.waiting) == ["cold", "long2"]
    assert core.queues().pending_destinations == ["h2"]


# --- each path, on a bare state -------------------------------------------------------------

_partial_ids = itertools.count().__next__


def record(request_id: str, *, prebuilt: bool) -> RequestState:
    seq = Sequence(
        [1, 2, 3, 4, 5],
        4,
        4,
        caching=False,
        rng=random.Random(0),
        token_bits=random.Random(0).getrandbits,
        next_partial_id=_partial_ids,
    )
    req = RequestState(request_id, seq, RequestStatus.WAITING)
    if prebuilt:
        req.num_computed_tokens = seq.num_allocated_tokens = seq.num_input_tokens
    return req


@pytest.fixture(params=["plain", "tallied"])
def state(request: pytest.FixtureRequest) -> SchedulerState:
    if request.param == "plain":
        return SchedulerState()
    return TalliedState(lambda req: None)


def fill(state: SchedulerState, spec: str) -> None:
    """Enqueue one request per letter: upper case prebuilt, lower case not."""
    for letter in spec:
        state.enqueue(record(letter, prebuilt=letter.isupper()))


def test_appends_keep_queue_order(state: SchedulerState) -> None:
    fill(state, "abCdE")
    assert list(state.waiting) == ["a", "b", "C", "d", "E"]
    assert state.next_waiting(True) == "C"
    assert state.next_waiting(False) == "a"
    check(state)


def test_a_prepended_prebuilt_request_comes_first(state: SchedulerState) -> None:
    fill(state, "aBc")
    parked = record("P", prebuilt=True)
    state.requests["P"] = parked
    state.prepend_waiting("P")
    assert list(state.waiting) == ["P", "a", "B", "c"]
    assert state.next_waiting(True) == "P"
    state.requests["q"] = record("q", prebuilt=False)
    state.prepend_waiting("q")
    assert state.next_waiting(True) == "P" and state.next_waiting(False) == "q"
    check(state)


def test_removal_from_the_middle(state: SchedulerState) -> None:
    fill(state, "aBcDe")
    state.remove_waiting("B")
    assert list(state.waiting) == ["a", "c", "D", "e"]
    assert state.next_waiting(True) == "D"
    state.remove_waiting("c")
    state.remove_waiting("c")  # gone already: nothing happens
    assert list(state.waiting) == ["a", "D", "e"]
    taken = state.take("D")
    assert taken.request_id == "D" and "D" not in state.requests
    assert state.next_waiting(True) is None
    check(state)


def test_admission_leaves_both_heads(state: SchedulerState) -> None:
    fill(state, "aBC")
    state.transition_to_running("B")
    assert state.next_waiting(True) == "C" and state.next_waiting(False) == "a"
    assert [r.request_id for r in state.running] == ["B"] and state.requests[
        "B"
    ].status is RequestStatus.RUNNING
    state.transition_to_running("a")
    assert list(state.waiting) == ["C"]
    check(state)


def test_a_reused_id_takes_its_new_place_and_status(state: SchedulerState) -> None:
    fill(state, "AbC")
    state.take("A")
    state.enqueue(record("A", prebuilt=False))
    assert list(state.waiting) == ["b", "C", "A"]
    assert state.next_waiting(True) == "C"
    state.take("C")
    assert state.next_waiting(True) is None
    state.take("b")
    state.enqueue(record("b", prebuilt=True))
    assert list(state.waiting) == ["A", "b"]
    assert state.next_waiting(True) == "b"
    check(state)


# --- the cost of a pass ---------------------------------------------------------------------


def test_a_decode_pass_does_not_walk_a_deep_waiting_queue(monkeypatch: pytest.MonkeyPatch) -> None:
    """20,000 fresh requests wait behind a destination that cannot get KV yet; a pass looks
    at none of them (the walk asked each whether it was prebuilt, on every pass)."""
    args = EngineArgs(
        block_size=4,
        num_gpu_blocks=16,
        max_num_seqs=8,
        worker_type=WorkerType.DECODE,
        speedup_ratio=0.0,
    )
    core = Engine(args)
    now = 0.0
    core.apply(
        ReserveDestination(
            "h0", Request(token_ids=list(range(40)), max_tokens=1_000, request_id="d0")
        ),
        now_ms=now,
    )
    core.apply(ActivateDestination("h0"), now_ms=now)
    now = core.execute_pass(now).end_ms
    core.apply(
        ReserveDestination(
            "h1", Request(token_ids=list(range(100, 140)), max_tokens=8, request_id="d1")
        ),
        now_ms=now,
    )
    assert core.queues().pending_destinations == ["h1"]
    for i in range(20_000):
        core.apply(
            Submit(Request(token_ids=[i, i + 1], max_tokens=4, request_id=f"r{i}")), now_ms=now
        )
    asked: list[str] = []
    original = RequestState.prompt_is_prebuilt

    def counted(req: RequestState) -> bool:
        asked.append(req.request_id)
        return original(req)

    monkeypatch.setattr(RequestState, "prompt_is_prebuilt", counted)
    for _ in range(10):
        now = core.execute_pass(now).end_ms
    assert core.queues().pending_destinations == ["h1"]
    assert len(core.parts.state.waiting) == 20_000
    assert asked == []
