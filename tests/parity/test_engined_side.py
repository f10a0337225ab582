"""engined's side of the harness: what a recording engine reports per pass."""

from __future__ import annotations

from engined.core.engine import Engine
from engined.core.types import Request, Submit
from parity import engined_side
from parity.scenarios import chunked_prompt, pressure
from parity.trace import Scheduled, Stored


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


def test_an_engine_not_recording_gives_no_trace() -> None:
    engine = Engine(engined_side.engine_args(chunked_prompt()))
    engine.apply(Submit(Request(token_ids=[1, 2, 3], max_tokens=2, request_id="a")), now_ms=0.0)
    assert engine.execute_pass(0.0).trace is None
