"""vLLM 0.33's `release_kv_cache_memory` and `reset_prefix_cache(reset_running_requests=True)`
in the core (engined/core/pausing.py), with vLLM's messages and exact values.

Engine as tests/core/test_pause.py's: vLLM semantics, bs 4, 32 blocks, budget 64, 3 seqs,
prompts of 8 tokens (2 blocks) and 4 tokens out.
"""

from __future__ import annotations

import pytest

from engined.core.args import Semantics
from engined.core.errors import InvalidRequestError, UnsupportedError
from engined.core.pausing import RELEASE_BEFORE_PAUSE, RELEASE_WHILE_ASLEEP, RESET_FAILED
from engined.core.types import (
    APPLIED,
    AllBlocksCleared,
    Pause,
    PauseMode,
    Refused,
    ReleaseKvCacheMemory,
    ReserveDestination,
    ResetPrefixCache,
    Sleep,
    WakeUp,
)
from tests.core.factories import make_args, make_core, request
from tests.core.test_pause import (
    engine,
    load,
    pause_gauges,
    readmitted_from_nothing,
    sleep_gauges,
)


def test_release_needs_a_completed_pause() -> None:
    core = engine()
    with pytest.raises(InvalidRequestError, match=r"^release_kv_cache_memory\(\) requires a"):
        core.apply(ReleaseKvCacheMemory(), now_ms=0.0)
    load(core, 1)
    core.execute_pass(0.0)
    core.apply(Pause(PauseMode.WAIT), now_ms=0.0)
    # The running request still has passes to go: the pause has not completed.
    with pytest.raises(InvalidRequestError) as refused:
        core.apply(ReleaseKvCacheMemory(), now_ms=0.0)
    assert str(refused.value) == RELEASE_BEFORE_PAUSE
    assert sleep_gauges(core.metrics()) == ((), False, 0)


def test_release_clears_the_cache_and_sleeps_the_kv_pool_until_woken() -> None:
    core = engine()
    load(core, 3)
    core.execute_pass(0.0)  # r0-r2 run
    core.apply(Pause(PauseMode.KEEP, clear_cache=False), now_ms=0.0)
    effects = core.apply(ReleaseKvCacheMemory(), now_ms=0.0)
    assert effects.result == APPLIED and effects.ended == []
    assert [type(e) for e in effects.kv_events] == [AllBlocksCleared]
    m = core.metrics()
    assert (m.running, m.waiting, m.preemptions_total, m.active_blocks) == (0, 3, 3, 0)
    # Still paused (PAUSED_ALL); the frontend records the engine asleep at level 0.
    assert pause_gauges(m) == (2, False, False)
    assert sleep_gauges(m) == (("kv_cache",), True, 0)
    with pytest.raises(InvalidRequestError) as again:
        core.apply(ReleaseKvCacheMemory(), now_ms=0.0)
    assert str(again.value) == RELEASE_WHILE_ASLEEP
    core.apply(WakeUp(("kv_cache",)), now_ms=0.0)
    assert pause_gauges(core.metrics()) == (0, False, False)
    assert sleep_gauges(core.metrics()) == ((), False, 0)
    readmitted_from_nothing(core)


def test_release_after_a_sleep_is_refused_as_vllm_refuses_it() -> None:
    core = engine()
    core.apply(Sleep(level=1), now_ms=0.0)
    with pytest.raises(InvalidRequestError) as refused:
        core.apply(ReleaseKvCacheMemory(), now_ms=0.0)
    assert str(refused.value) == RELEASE_WHILE_ASLEEP


def test_reset_running_requests_preempts_them_last_first_then_clears() -> None:
    core = engine()
    load(core, 3)
    core.execute_pass(0.0)
    assert isinstance(core.apply(ResetPrefixCache(), now_ms=0.0).result, Refused)
    effects = core.apply(ResetPrefixCache(reset_running_requests=True), now_ms=0.0)
    assert effects.result == APPLIED
    assert [type(e) for e in effects.kv_events] == [AllBlocksCleared]
    m = core.metrics()
    assert (m.running, m.waiting, m.preemptions_total, m.active_blocks) == (0, 3, 3, 0)
    resumed = core.execute_pass(0.0)
    assert resumed.trace is not None and resumed.trace.preempted == ["r2", "r1", "r0"]
    assert [(a.request_id, a.reused_input_tokens) for a in resumed.admissions] == [
        ("r0", 0),
        ("r1", 0),
        ("r2", 0),
    ]


def test_reset_running_requests_fails_as_vllm_while_a_destination_holds_blocks() -> None:
    core = engine()
    core.apply(ReserveDestination("h1", request("d1", range(1, 9), 4)), now_ms=0.0)
    with pytest.raises(InvalidRequestError) as failed:
        core.apply(ResetPrefixCache(reset_running_requests=True), now_ms=0.0)
    assert str(failed.value) == RESET_FAILED


def test_mocker_semantics_refuse_resetting_running_requests_and_release() -> None:
    core = make_core(make_args(semantics=Semantics.MOCKER_1_3_0))
    with pytest.raises(UnsupportedError, match="vLLM semantics"):
        core.apply(ResetPrefixCache(reset_running_requests=True), now_ms=0.0)
    with pytest.raises(UnsupportedError, match="vLLM semantics"):
        core.apply(ReleaseKvCacheMemory(), now_ms=0.0)
