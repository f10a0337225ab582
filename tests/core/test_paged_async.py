"""`async_scheduling`: vLLM 0.33's AsyncScheduler under EngineCore's batch queue of 2.

Each expectation is what vLLM does for the same stream (the parity harness's `-async`
scenarios check whole streams against the real AsyncScheduler, step by step).
"""

from __future__ import annotations

from typing import Any

import pytest

from engined.core.engine import Engine
from engined.core.errors import InvalidArgsError
from engined.core.types import Cancel, FinishReason, PassResult
from engined.core.views import RequestPlace
from tests.core.factories import make_args, passes, request, shares, submit, view
from tests.core.test_paged_semantics import paged_args, shape, vllm_hashes

_LENGTH = FinishReason.LENGTH


def async_args(**overrides: Any) -> Any:
    return paged_args(async_scheduling=True, **overrides)


def outputs(result: PassResult) -> list[tuple[str, list[int], FinishReason | None]]:
    return [(o.request_id, o.new_token_ids, o.finish_reason) for o in result.request_outputs()]


def test_a_pass_schedules_a_placeholder_and_delivers_the_batch_before() -> None:
    """Pass 0 schedules the prompt and delivers nothing (no events either: vLLM publishes
    them when it updates). Each later pass schedules the token still being sampled, at the
    position after the prompt, and delivers the token before it; the pass after the last
    token is in flight schedules nothing and delivers it. Same tokens, at the same modeled
    times, as the synchronous scheduler's, one pass later."""
    sync = Engine(paged_args(), record=True)
    submit(sync, request("a", range(8), 3))
    expected = passes(sync, 3)
    core = Engine(async_args(), record=True)
    submit(core, request("a", range(8), 3))
    results = passes(core, 4)
    assert [shares(r) for r in results] == [[("a", 0, 8)], [("a", 8, 1)], [("a", 9, 1)], []]
    assert [outputs(r) for r in results[1:]] == [outputs(r) for r in expected]
    assert outputs(results[0]) == []
    assert [r.end_ms for r in results[1:]] == [r.end_ms for r in expected]
    assert results[0].end_ms == 0.0
    assert results[0].progressed
    assert shape(results[0].kv_events) == []
    assert shape(results[1].kv_events) == [("stored", vllm_hashes(list(range(8)), 4), None)]
    assert results[3].ended[0].reason is _LENGTH
    assert core.is_empty()


def test_the_placeholder_slot_preempts_at_schedule_and_stale_output_is_delivered() -> None:
    """4 usable blocks, two 8-token prompts (2 blocks each): the next pass schedules a's
    placeholder at position 8, whose slot needs a third block, so b is preempted then. b's
    first token, sampled by the batch in flight, is still delivered in that pass; b keeps it
    (1 output token) with nothing computed and no placeholder."""
    core = Engine(async_args(num_gpu_blocks=5, enable_prefix_caching=False), record=True)
    submit(core, request("a", range(8), 4))
    submit(core, request("b", range(100, 108), 4))
    first, second = passes(core, 2)
    assert shares(first) == [("a", 0, 8), ("b", 0, 8)]
    assert shares(second) == [("a", 8, 1)]
    assert second.trace is not None and second.trace.preempted == ["b"]
    assert [(rid, len(tokens)) for rid, tokens, _ in outputs(second)] == [("a", 1), ("b", 1)]
    b = view(core, "b")
    assert (b.place, b.output_tokens, b.num_computed_tokens) == (RequestPlace.WAITING, 1, 0)
    assert core.parts.state.requests["b"].num_output_placeholders == 0


def test_a_request_cancelled_in_flight_gets_nothing_from_its_batch() -> None:
    core = Engine(async_args(), record=True)
    submit(core, request("a", range(8), 3))
    first = core.execute_pass(0.0)
    assert shares(first) == [("a", 0, 8)]
    core.apply(Cancel("a"), now_ms=first.end_ms)
    assert core.is_empty()
    second = core.execute_pass(first.end_ms)
    assert outputs(second) == []
    assert shares(second) == []


@pytest.mark.parametrize(
    ("fields", "named"),
    [
        ({"async_scheduling": True}, "async_scheduling"),
        ({"enable_lora": True}, "enable_lora"),
        ({"long_prefill_token_threshold": 48}, "long_prefill_token_threshold=48"),
        ({"max_num_active_seqs": 2}, "max_num_active_seqs"),
        ({"prefill_schedule_interval": 2}, "prefill_schedule_interval=2"),
        ({"max_num_scheduled_tokens": 64}, "max_num_scheduled_tokens"),
        ({"watermark": 0.1}, "watermark=0.1"),
    ],
)
def test_vllms_scheduler_options_need_vllm_semantics(fields: dict[str, Any], named: str) -> None:
    """Refused under the mocker's, by name (and value where it is not a switch)."""
    with pytest.raises(InvalidArgsError) as raised:
        Engine(make_args(**fields))
    (key,) = fields
    assert raised.value.key == key
    assert str(raised.value).startswith(f"{named} needs vLLM semantics (")
