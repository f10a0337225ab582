"""engined's side of the harness: what a recording engine reports per pass."""

from __future__ import annotations

from engined.core.engine import Engine
from engined.core.types import Request, Submit
from parity import engined_side
from parity.abort_scenarios import abort_shared_prefix
from parity.lora_scenarios import lora_pressure, lora_shared_prefix
from parity.scenarios import cache_salt, chunked_prompt, pressure, stop_pressure
from parity.trace import Scheduled, StopReport, Stored


def test_chunked_prefill_steps_and_stores() -> None:
    trace = engined_side.run(chunked_prompt())
    assert [s.scheduled for s in trace.steps] == [
        [Scheduled("r0", 0, 64)],
        [Scheduled("r0", 64, 64)],
        [Scheduled("r0", 128, 64)],
        [Scheduled("r0", 192, 64)],
        [Scheduled("r0", 256, 44)],
        *([Scheduled("r0", 300 + i, 1)] for i in range(7)),
    ]
    stored = [
        sum(len(e.block_hashes) for e in s.events if isinstance(e, Stored)) for s in trace.steps
    ]
    # The 19th block (tokens 288-303) fills with the 4th generated token, at step 8.
    assert stored == [4, 4, 4, 4, 2, 0, 0, 0, 1, 0, 0, 0]
    assert [s.finished for s in trace.steps][-1] == ["r0"]
    assert len(trace.output_tokens["r0"]) == 8


def test_preemption_victims_in_order() -> None:
    """vLLM's numbers: five admitted at step 0 (the pool holds five 64-token prompts and
    their first tokens), the newest preempted at step 1 when the others grow, and nobody
    admitted in a step that preempted."""
    trace = engined_side.run(pressure())
    assert [a.request_id for a in trace.steps[0].admitted] == ["p0", "p1", "p2", "p3", "p4"]
    assert trace.steps[1].preempted == ["p4"]
    assert all(not s.admitted for s in trace.steps if s.preempted)
    total = sum(len(s.preempted) for s in trace.steps)
    assert total == sum(1 for s in trace.steps for a in s.admitted) - 12


def test_stops_are_reported_with_their_ids_never_before_min_tokens() -> None:
    """Stop ids 3 and 11 under a 16-id vocabulary: every stopped request ends on one, after
    its min_tokens; the planned output stops on its 30th token; t11 (min_tokens 80 =
    max_tokens) and the two without stop ids run to their length."""
    scenario = stop_pressure()
    trace = engined_side.run(scenario)
    stopped = {r.request_id: r.stop_reason for s in trace.steps for r in s.stopped}
    assert sorted(stopped) == sorted(
        ["t0", "t1", "t2", "t3", "t4", "t6", "t7", "t8", "t10", "t-planned"]
    )
    for request in scenario.requests:
        tokens = trace.output_tokens[request.id]
        early = [t for t in tokens[: request.min_tokens - 1] if t in request.stop_token_ids]
        assert early == []
        if request.id in stopped:
            assert tokens[-1] == stopped[request.id]
            assert len(tokens) >= max(request.min_tokens, 1)
        else:
            assert len(tokens) == request.max_tokens
    assert len(trace.output_tokens["t-planned"]) == 30
    assert StopReport("t0", 11) in [r for s in trace.steps for r in s.stopped]


def test_salted_stores_carry_the_salt_and_hit_only_their_own() -> None:
    trace = engined_side.run(cache_salt())
    roots = [
        (e.extra_keys or [None])[0]
        for s in trace.steps
        for e in s.events
        if isinstance(e, Stored) and e.parent is None
    ]
    assert roots[:3] == [["a"], ["b"], None]
    cached = {c.request_id: c.cached_tokens for s in trace.steps for c in s.cached}
    # c2 and c4 have no salt ("" is none); c3 and c5 find their own salt's prefix; the
    # short prompt's generated first block is hit under its salt only.
    assert (cached["c2"], cached["c3"], cached["c4"]) == (0, 64, 64)
    assert (cached["c-grown0"], cached["c-grown1"], cached["c-grown2"]) == (16, 0, 16)


def test_lora_stores_carry_the_adapter_and_hit_only_their_own() -> None:
    """The first Stored of each root names its adapter. k3 (sql) hits k0's prefix and k5
    (chat) what eviction left of k1's; k4 (sql, salted), k6 (sql at another path) and k7
    (salted, base) share nothing with earlier requests, and k8 (sql, salted) comes after
    k4's blocks were evicted (vLLM's numbers, as the lora-salt-shared-prefix scenario
    checks). The short sql prompt's generated first block is hit by sql only."""
    trace = engined_side.run(lora_shared_prefix())
    roots = [
        (e.lora_id, e.lora_name, (e.extra_keys or [None])[0])
        for s in trace.steps
        for e in s.events
        if isinstance(e, Stored) and e.parent is None
    ]
    assert roots[:3] == [(1, "sql", ["sql"]), (2, "chat", ["chat"]), (None, None, None)]
    cached = {c.request_id: c.cached_tokens for s in trace.steps for c in s.cached}
    assert [cached[f"k{i}"] for i in range(3, 9)] == [64, 0, 32, 0, 0, 0]
    assert [cached[f"k-grown{i}"] for i in range(4)] == [16, 0, 0, 16]


def test_max_loras_holds_a_third_adapter_back() -> None:
    """max_loras 2: of the first four (sql, chat, base, math), math waits while sql, chat
    and the base model run."""
    trace = engined_side.run(lora_pressure())
    assert [a.request_id for a in trace.steps[0].admitted] == ["l0", "l1", "l2"]
    assert (trace.steps[0].running, trace.steps[0].waiting) == (3, 1)


def test_an_engine_not_recording_gives_no_trace() -> None:
    engine = Engine(engined_side.engine_args(chunked_prompt()))
    engine.apply(Submit(Request(token_ids=[1, 2, 3], max_tokens=2, request_id="a")), now_ms=0.0)
    assert engine.execute_pass(0.0).trace is None


def test_aborts_end_requests_wherever_they_are() -> None:
    """The abort scenario reaches every state its docstring names (so its parity covers
    them), and an aborted request is neither scheduled nor finished afterwards."""
    scenario = abort_shared_prefix()
    trace = engined_side.run(scenario)

    def last_scheduled(request_id: str, before: int) -> Scheduled:
        return [x for s in trace.steps[:before] for x in s.scheduled if x.request_id == request_id][
            -1
        ]

    # a0 mid-prefill at step 2 (64 of its 104 prompt tokens), a2 mid-prefill and a1 decoding.
    assert last_scheduled("a0", 2) == Scheduled("a0", 32, 32)
    assert last_scheduled("a2", 4) == Scheduled("a2", 64, 24)
    assert last_scheduled("a1", 4) == Scheduled("a1", 96, 8)
    assert trace.steps[16].preempted == ["a5"]
    assert last_scheduled("a7", 23) == Scheduled("a7", 64, 30)
    assert any("again0" in s.finished for s in trace.steps[:40])
    for control in scenario.controls:
        for request_id in control.request_ids:
            after = trace.steps[control.step :]
            assert not any(x.request_id == request_id for s in after for x in s.scheduled)
            if request_id != "again0":
                assert not any(request_id in s.finished for s in trace.steps)
    assert "again3" not in trace.output_tokens
