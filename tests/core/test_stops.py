"""`stop_token_ids` and `min_tokens` as vLLM 0.33 honours them (engined/core/stops.py).

vLLM's `check_stop` ends a request when the token just appended is a stop id (finish reason
"stop", the token counted and emitted, `stop_reason` the id), and `MinTokensLogitsProcessor`
keeps stop ids from being sampled before `min_tokens`. The parity harness checks whole
streams against vLLM's scheduler (the `stop-*` scenarios); these pin each rule with numbers.
"""

from __future__ import annotations

from typing import Any

import pytest

from engined.core.args import Semantics
from engined.core.engine import Engine
from engined.core.errors import InvalidRequestError
from engined.core.token_stream import token_bits
from engined.core.types import EndedRequest, FinishReason, PassResult, Request, Submit
from engined.core.vocab import Vocabulary
from tests.core.factories import make_args, submit
from tests.core.test_paged_semantics import paged_args

SEMANTICS = [Semantics.VLLM, Semantics.MOCKER_1_3_0]
PROMPT = list(range(100, 110))


def stopping(request_id: str, **fields: Any) -> Request:
    fields.setdefault("max_tokens", 30)
    return Request(token_ids=PROMPT, request_id=request_id, **fields)


def args_for(semantics: Semantics, **overrides: Any) -> Any:
    fields: dict[str, Any] = {"num_gpu_blocks": 64, "max_num_batched_tokens": 64}
    fields.update(overrides)
    if semantics is Semantics.VLLM:
        return paged_args(**fields)
    return make_args(semantics=semantics, **fields)


def drain(core: Engine) -> tuple[dict[str, list[int]], dict[str, tuple[Any, Any]], int]:
    """Every request's tokens, its (finish reason, stop reason), and the passes it took."""
    tokens: dict[str, list[int]] = {}
    ends: dict[str, tuple[Any, Any]] = {}
    now = 0.0
    for count in range(1, 500):
        result = core.execute_pass(now)
        for out in result.request_outputs():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finish_reason is not None:
                ends[out.request_id] = (out.finish_reason, out.stop_reason)
        now = result.end_ms
        if core.is_empty():
            return tokens, ends, count
    raise AssertionError("did not drain")


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_a_planned_stop_id_ends_the_request_with_the_token_counted(semantics: Semantics) -> None:
    core = Engine(args_for(semantics))
    submit(core, stopping("a", output_token_ids=[5, 3, 6, 3, 7], stop_token_ids=[3]))
    tokens, ends, _ = drain(core)
    assert tokens == {"a": [5, 3]}
    assert ends == {"a": (FinishReason.STOP, 3)}


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_min_tokens_holds_back_a_planned_stop(semantics: Semantics) -> None:
    """The 3 at output position 2 is the 2nd token, before min_tokens 3; the next 3 (the 4th
    token) stops the request."""
    core = Engine(args_for(semantics))
    planned = [5, 3, 6, 3, 7]
    submit(core, stopping("a", output_token_ids=planned, stop_token_ids=[3], min_tokens=3))
    tokens, ends, _ = drain(core)
    assert tokens == {"a": [5, 3, 6, 3]}
    assert ends == {"a": (FinishReason.STOP, 3)}


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_a_stop_id_as_the_last_allowed_token_is_a_stop_not_a_length(semantics: Semantics) -> None:
    """vLLM's check_stop tests stop ids before the length."""
    core = Engine(args_for(semantics))
    submit(core, stopping("a", output_token_ids=[5, 6, 3], stop_token_ids=[3, 4]))
    submit(core, stopping("b", output_token_ids=[5, 6, 7], stop_token_ids=[3, 4]))
    tokens, ends, _ = drain(core)
    assert tokens == {"a": [5, 6, 3], "b": [5, 6, 7]}
    assert ends == {"a": (FinishReason.STOP, 3), "b": (FinishReason.LENGTH, None)}


def masked_draws(name: str, count: int, stops: set[int], min_tokens: int) -> list[int]:
    """What vLLM's masked sampler amounts to on the request's stream: before `min_tokens`
    a stop id is drawn again (vocabulary of 4 ids, engine seed 0)."""
    bits = token_bits(0, name, None, PROMPT)
    vocab = Vocabulary(4)
    out: list[int] = []
    while len(out) < count:
        token = vocab.next_token(bits)
        while len(out) < min_tokens and token in stops:
            token = vocab.next_token(bits)
        out.append(token)
    return out


@pytest.mark.parametrize("semantics", SEMANTICS)
def test_drawn_tokens_never_hit_a_stop_id_before_min_tokens(semantics: Semantics) -> None:
    """Vocabulary {0, 1, 2, 3}, stop ids {1, 2}: half the draws are stop ids. Before the 6th
    token they are drawn again; from it on the first one ends the request."""
    core = Engine(args_for(semantics, vocab_size=4))
    submit(core, stopping("a", stop_token_ids=[1, 2], min_tokens=6))
    submit(core, stopping("b", stop_token_ids=[1, 2]))
    tokens, ends, _ = drain(core)
    assert tokens == {"a": [0, 0, 3, 0, 0, 3, 1], "b": [0, 3, 0, 1]}
    assert tokens["a"] == masked_draws("a", 7, {1, 2}, 6)
    # Unmasked, `a`'s stream has a stop id 2nd: the mask drew the 0 after it instead.
    assert masked_draws("a", 3, set(), 0) == [0, 1, 0]
    assert tokens["b"] == masked_draws("b", 4, {1, 2}, 0)
    assert ends == {"a": (FinishReason.STOP, 1), "b": (FinishReason.STOP, 1)}


def test_min_tokens_cannot_mask_a_vocabulary_of_stop_ids_only() -> None:
    """Only id 1 is drawable and it is the stop id: the draws stand (vLLM's mask would leave
    nothing to sample), and the request stops at min_tokens."""
    core = Engine(args_for(Semantics.VLLM, vocab_size=2, excluded_token_ids=[0]))
    submit(core, stopping("a", stop_token_ids=[1], min_tokens=3))
    tokens, ends, _ = drain(core)
    assert tokens == {"a": [1, 1, 1]}
    assert ends == {"a": (FinishReason.STOP, 1)}


def test_a_stopped_request_is_freed_in_its_pass_and_the_next_is_admitted_after() -> None:
    """max_num_seqs 1: `a` stops on its 2nd token in pass 2 and leaves at once (its blocks
    freed, its end reported); `b` is admitted in pass 3, as vLLM's next schedule() does."""
    core = Engine(args_for(Semantics.VLLM, max_num_seqs=1))
    submit(core, stopping("a", output_token_ids=[5, 3, 6], stop_token_ids=[3]))
    submit(core, stopping("b", max_tokens=1))
    results: list[PassResult] = []
    now = 0.0
    while not core.is_empty():
        results.append(core.execute_pass(now))
        now = results[-1].end_ms
    assert [[a.request_id for a in r.admissions] for r in results] == [["a"], [], ["b"]]
    assert results[1].ended == [EndedRequest("a", FinishReason.STOP)]
    assert results[1].metrics.running == 0
    assert results[1].metrics.active_blocks == 0


def test_an_mtp_burst_ends_at_its_stop_id_and_drops_the_rest() -> None:
    """Accept rates 1.0, 1.0: every burst is three tokens. The first burst would be 1, 3, 5;
    it stops at 3, and 5 is neither emitted nor counted."""
    core = Engine(args_for(Semantics.MOCKER_1_3_0, aic_nextn=2, aic_nextn_accept_rates="1.0,1.0"))
    submit(core, stopping("a", output_token_ids=[1, 3, 5, 6, 7, 8], stop_token_ids=[3]))
    now = 0.0
    emitted = []
    while not core.is_empty():
        result = core.execute_pass(now)
        emitted.append(result.accept_length_output_tokens)
        now = result.end_ms
        outputs = result.request_outputs()
    assert [(o.new_token_ids, o.finish_reason, o.stop_reason) for o in outputs] == [
        ([1, 3], FinishReason.STOP, 3)
    ]
    assert sum(emitted) == 2
    assert core.metrics().active_blocks == 0


def test_async_scheduling_drops_the_token_in_flight_after_a_stop() -> None:
    """The batch that samples the stop id is resolved while the next one, scheduled with a
    placeholder for the token after it, is in flight: that token is never delivered."""
    core = Engine(args_for(Semantics.VLLM, async_scheduling=True))
    submit(core, stopping("a", output_token_ids=[5, 3, 6, 7], stop_token_ids=[3]))
    tokens, ends, passes = drain(core)
    assert tokens == {"a": [5, 3]}
    assert ends == {"a": (FinishReason.STOP, 3)}
    assert passes == 3


def test_a_stop_token_that_needs_a_block_preempts_and_still_stops() -> None:
    """The mocker's pool (3 blocks, no null block) is full with `a` (1 block) and `b` (2):
    `a`'s stop token opens a block, which preempts `b`, and then ends `a`."""
    core = Engine(args_for(Semantics.MOCKER_1_3_0, num_gpu_blocks=3, max_num_batched_tokens=16))
    submit(
        core,
        Request(
            token_ids=[1, 2, 3, 4],
            max_tokens=2,
            request_id="a",
            output_token_ids=[9, 8],
            stop_token_ids=[9],
        ),
    )
    submit(
        core,
        Request(
            token_ids=list(range(10, 18)), max_tokens=2, request_id="b", output_token_ids=[7, 7]
        ),
    )
    tokens, ends, passes = drain(core)
    assert tokens == {"a": [9], "b": [7, 7]}
    assert ends == {"a": (FinishReason.STOP, 9), "b": (FinishReason.LENGTH, None)}
    assert core.metrics().preemptions_total == 1
    assert passes == 3


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        (
            {"max_tokens": 4, "min_tokens": 5},
            "request.min_tokens must be less than or equal to max_tokens=4, got 5.",
        ),
        (
            {"max_tokens": 40, "output_token_ids": [1, 2], "min_tokens": 3},
            "request.min_tokens must be less than or equal to max_tokens=2, got 3.",
        ),
        (
            {"max_tokens": 4, "min_tokens": -1},
            "request.min_tokens must be greater than or equal to 0, got -1.",
        ),
    ],
)
def test_min_tokens_beyond_the_output_is_refused(fields: dict[str, Any], message: str) -> None:
    core = Engine(args_for(Semantics.VLLM))
    with pytest.raises(InvalidRequestError) as raised:
        core.apply(Submit(Request(token_ids=PROMPT, request_id="a", **fields)), now_ms=0.0)
    assert str(raised.value) == message
    assert core.is_empty()
