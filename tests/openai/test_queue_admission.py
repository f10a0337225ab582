"""vLLM's API-server admission control, in one process: the counters the daemon shares with
its API servers (engined.admission_counters) and the rules of `--max-num-queued-reqs` and
`--max-num-queued-tokens` (engined.openai.queue_admission), as vLLM 0.33's
`AsyncLLM.check_admission` applies them. tests/openai/test_queue_limits.py runs them in a
real daemon through the `openai` client."""

from __future__ import annotations

import os
from collections.abc import AsyncGenerator, Iterator

import pytest

from engined.admission_counters import AdmissionCounters
from engined.openai.api_errors import ApiError, engine_overloaded, prefill_backlog_full
from engined.openai.http import ClosingBody
from engined.openai.queue_admission import Admission
from tests.support import run


@pytest.fixture
def counters() -> Iterator[AdmissionCounters]:
    shared = AdmissionCounters.create(1)
    yield shared
    shared.close()


def refusal(admission: Admission, n: int) -> bytes | None:
    """The body of the 503 `check(n)` raises, or None when it admits."""
    try:
        admission.check(n)
    except ApiError as error:
        assert error.status == 503
        return error.body()
    return None


OVERLOADED = engine_overloaded().body()
BACKLOG = prefill_backlog_full().body()


def test_no_limits_admit_everything(counters: AdmissionCounters) -> None:
    admission = Admission(max_requests=None, max_tokens=None, counters=counters)
    admission.admit([10**6] * 100, 8)
    assert refusal(admission, 10**6) is None
    assert (admission.requests, admission.prefill_tokens) == (800, 100 * 8 * 10**6)
    assert counters.rejections() == (0, 0)


def test_requests_count_each_sample_and_refuse_past_the_limit(
    counters: AdmissionCounters,
) -> None:
    admission = Admission(max_requests=3, max_tokens=None, counters=counters)
    # vLLM: current + n > max refuses; n alone may exceed it.
    assert refusal(admission, 4) == OVERLOADED
    assert refusal(admission, 3) is None
    tickets = admission.admit([5], 2)
    assert (admission.requests, counters.requests()) == (2, 2)
    assert refusal(admission, 2) == OVERLOADED
    assert refusal(admission, 1) is None
    tickets[0].leave()
    tickets[0].leave()  # once only
    assert (admission.requests, counters.requests()) == (1, 1)
    assert refusal(admission, 2) is None
    assert counters.rejections() == (2, 0)


def test_tokens_refuse_at_the_limit_and_count_until_the_first_output(
    counters: AdmissionCounters,
) -> None:
    admission = Admission(max_requests=None, max_tokens=100, counters=counters)
    # vLLM: the backlog as it is, not the request's own prompt (>= max refuses).
    first = admission.admit([99], 1)
    assert refusal(admission, 1) is None
    second = admission.admit([1], 1)
    assert admission.prefill_tokens == 100
    assert refusal(admission, 1) == BACKLOG
    first[0].output()
    assert admission.prefill_tokens == 1 and admission.requests == 2
    assert refusal(admission, 1) is None
    first[0].leave()
    second[0].leave()
    assert (admission.requests, admission.prefill_tokens) == (0, 0)
    assert counters.rejections() == (0, 1)


def test_zero_limits_refuse_everything(counters: AdmissionCounters) -> None:
    """vLLM's `ge=0` bounds: 0 requests, or a backlog of 0 tokens, admits nothing."""
    assert refusal(Admission(max_requests=0, max_tokens=None, counters=counters), 1) == OVERLOADED
    assert refusal(Admission(max_requests=None, max_tokens=0, counters=counters), 1) == BACKLOG
    # Requests are checked first, as vLLM's do.
    assert refusal(Admission(max_requests=0, max_tokens=0, counters=counters), 1) == OVERLOADED
    assert counters.rejections() == (2, 1)


def test_prompts_are_added_one_by_one_and_a_refusal_adds_none(
    counters: AdmissionCounters,
) -> None:
    """A completion's prompts are added in turn, each checked with what went before (vLLM's
    `_add_request` per prompt); when one is refused, those before it are taken back."""
    admission = Admission(max_requests=None, max_tokens=100, counters=counters)
    with pytest.raises(ApiError):
        admission.admit([50, 60, 5], 1)  # 0, then 50, then 110 >= 100: the third is refused
    assert (admission.requests, admission.prefill_tokens) == (0, 0)
    tickets = admission.admit([50, 49, 5], 1)  # 0, 50, 99: all three
    assert (admission.requests, admission.prefill_tokens) == (3, 104)
    by_requests = Admission(max_requests=4, max_tokens=None, counters=counters)
    with pytest.raises(ApiError):
        by_requests.admit([1, 1, 1], 2)  # 2 + 2 > 4 at the third
    assert by_requests.requests == 0
    assert counters.rejections() == (1, 1)
    for ticket in tickets:
        ticket.leave()


def test_processes_share_the_request_count_and_the_rejections() -> None:
    """Each process writes its own slot and reads the sum: three processes, as the daemon's
    API servers map one descriptor (here three mappings of duplicates of it)."""
    owner = AdmissionCounters.create(3)
    try:
        slots = [AdmissionCounters.attach(os.dup(owner.fd), 3, i) for i in range(3)]
        admissions = [Admission(max_requests=4, max_tokens=None, counters=c) for c in slots]
        admissions[0].admit([1], 2)
        admissions[1].admit([1], 1)
        assert [c.requests() for c in slots] == [3, 3, 3]
        assert refusal(admissions[2], 2) == OVERLOADED
        assert refusal(admissions[2], 1) is None
        admissions[2].admit([1], 1)
        assert refusal(admissions[0], 1) == OVERLOADED
        assert owner.rejections() == (2, 0)
        for c in slots:
            c.close()
        # A scrape during shutdown reads the last values, not unmapped memory.
        owner.close()
        assert owner.rejections() == (2, 0)
    finally:
        owner.close()


def test_a_slot_outside_the_processes_is_refused() -> None:
    owner = AdmissionCounters.create(2)
    try:
        with pytest.raises(ValueError, match="slot 2 of 2"):
            AdmissionCounters.attach(owner.fd, 2, 2)
    finally:
        owner.close()


def test_a_stream_closed_before_its_first_chunk_still_closes_its_generation() -> None:
    """The HTTP side aclose()s a body however its stream ended; a generator that never
    started runs no `finally`, so the body runs its closing itself (a generation's engine
    requests are cancelled and leave the count), once."""
    closed: list[str] = []

    async def close_generation() -> None:
        closed.append("generation")

    async def chunks() -> AsyncGenerator[bytes, None]:
        try:
            yield b"data"
        finally:
            closed.append("chunks")

    async def scenario() -> None:
        never_started = ClosingBody(chunks(), close_generation)
        await never_started.aclose()
        await never_started.aclose()
        assert closed == ["generation"]
        started = ClosingBody(chunks(), close_generation)
        assert await anext(started) == b"data"
        closed.clear()
        await started.aclose()
        assert closed == ["chunks", "generation"]

    run(scenario())
