"""vLLM 0.33's pause and sleep in the core (engined/core/pausing.py), with exact values.

Engine: vLLM semantics, bs 4, 32 blocks (31 usable), budget 64, 3 seqs, prefix caching on,
passes of no modeled time. Prompts of 8 tokens (2 blocks) and 4 tokens out: a request is
admitted in a pass (prefill, first token), decodes 3 more passes, and ends in its 4th.
"""

from __future__ import annotations

import msgspec
import pytest

from engined.core.args import EngineArgs, PerfModelKind, Semantics
from engined.core.engine import Engine
from engined.core.errors import InvalidRequestError, UnsupportedError
from engined.core.types import (
    APPLIED,
    NOOP,
    ActivateDestination,
    AllBlocksCleared,
    EndedRequest,
    EngineMetrics,
    FinishReason,
    Pause,
    PauseMode,
    ReserveDestination,
    ResetPrefixCache,
    Resume,
    Sleep,
    WakeUp,
)
from tests.core.factories import make_args, make_core, request, submit

_AWAKE = ((), False, 0)


def engine() -> Engine:
    return Engine(
        EngineArgs(
            block_size=4,
            num_gpu_blocks=32,
            max_num_batched_tokens=64,
            max_num_seqs=3,
            enable_prefix_caching=True,
            speedup_ratio=0.0,
            perf_model=PerfModelKind.FIXED,
            fixed_prefill_ms_per_token=0.0,
            fixed_pass_overhead_ms=0.0,
            fixed_decode_ms_per_pass=0.0,
        ),
        record=True,
    )


def pause_gauges(m: EngineMetrics) -> tuple[int, bool, bool]:
    return (m.pause_state, m.pause_pending, m.rejecting)


def sleep_gauges(m: EngineMetrics) -> tuple[tuple[str, ...], bool, int]:
    return (m.sleeping_tags, m.asleep, m.sleep_level)


def readmitted_from_nothing(core: Engine) -> None:
    """The next pass admits r0, r1, r2 again, in order, with nothing cached."""
    resumed = core.execute_pass(0.0)
    assert [(a.request_id, a.reused_input_tokens) for a in resumed.admissions] == [
        ("r0", 0),
        ("r1", 0),
        ("r2", 0),
    ]


def load(core: Engine, n: int, start: int = 0) -> list[str]:
    return [
        submit(core, request(f"r{i}", range(100 * i + 1, 100 * i + 9), 4))
        for i in range(start, start + n)
    ]


def test_abort_ends_every_request_and_clears_the_cache_after_one_pass() -> None:
    core = engine()
    load(core, 4)
    core.execute_pass(0.0)  # r0-r2 run, r3 waits
    effects = core.apply(Pause(PauseMode.ABORT), now_ms=0.0)
    assert effects.result == APPLIED
    assert effects.ended == [EndedRequest(f"r{i}", FinishReason.CANCELLED) for i in range(4)]
    # The aborts are vLLM's finished_req_ids: one more step runs before the pause completes.
    assert effects.kv_events == []
    assert pause_gauges(core.metrics()) == (1, True, True)
    assert not core.is_empty()
    done = core.execute_pass(0.0)
    assert done.progressed and done.request_outputs() == []
    assert [type(e) for e in done.kv_events] == [AllBlocksCleared]
    assert pause_gauges(done.metrics) == (1, False, True)
    assert (done.metrics.active_blocks, done.metrics.inactive_blocks) == (0, 0)
    assert core.is_empty()
    assert not core.execute_pass(0.0).progressed


def test_a_pause_of_an_idle_engine_completes_at_once() -> None:
    core = engine()
    effects = core.apply(Pause(PauseMode.WAIT), now_ms=0.0)
    assert [type(e) for e in effects.kv_events] == [AllBlocksCleared]
    assert pause_gauges(core.metrics()) == (1, False, True)
    kept = core.apply(Pause(PauseMode.KEEP, clear_cache=False), now_ms=0.0)
    assert kept.kv_events == []
    # `keep` stops rejecting (vLLM's pause_generation sets reject_new_requests per mode).
    assert pause_gauges(core.metrics()) == (2, False, False)


def test_wait_drains_the_running_keeps_the_queued_and_clears_when_idle() -> None:
    core = engine()
    load(core, 4)
    core.execute_pass(0.0)
    assert core.apply(Pause(PauseMode.WAIT), now_ms=0.0).ended == []
    submit(core, request("late", range(900, 908), 2))
    ended: list[str] = []
    cleared_at = None
    for index in range(8):
        result = core.execute_pass(0.0)
        assert result.admissions == []
        ended += [e.request_id for e in result.ended]
        if any(isinstance(e, AllBlocksCleared) for e in result.kv_events):
            cleared_at = index
    # r0-r2 end in the 3rd pass; the 4th (their finished ids) leaves the engine idle.
    assert ended == ["r0", "r1", "r2"]
    assert cleared_at == 3
    m = core.metrics()
    assert (m.running, m.waiting, m.active_blocks, m.inactive_blocks) == (0, 2, 0, 0)
    assert pause_gauges(m) == (1, False, True)
    assert not core.is_empty()
    assert core.apply(Resume(), now_ms=0.0).result == APPLIED
    assert pause_gauges(core.metrics()) == (0, False, False)
    resumed = core.execute_pass(0.0)
    # Nothing cached survived: r3 and late compute their whole prompts.
    assert [(a.request_id, a.reused_input_tokens) for a in resumed.admissions] == [
        ("r3", 0),
        ("late", 0),
    ]


def test_keep_freezes_everything_and_its_clear_preempts_the_running() -> None:
    core = engine()
    load(core, 4)
    first = core.execute_pass(0.0)
    tokens = {o.request_id: o.new_token_ids for o in first.request_outputs()}
    effects = core.apply(Pause(PauseMode.KEEP), now_ms=0.0)
    assert effects.ended == []
    assert [type(e) for e in effects.kv_events] == [AllBlocksCleared]
    m = core.metrics()
    assert (m.running, m.waiting, m.preemptions_total) == (0, 4, 3)
    assert pause_gauges(m) == (2, False, False)
    # Frozen: no pass runs (EngineCore has no work under PAUSED_ALL).
    frozen = core.execute_pass(0.0)
    assert not frozen.progressed
    assert frozen.trace is not None and frozen.trace.preempted == ["r2", "r1", "r0"]
    core.apply(Resume(), now_ms=0.0)
    # Back in their running order, recomputing the prompt and the token they had.
    readmitted_from_nothing(core)
    assert all(len(tokens[f"r{i}"]) == 1 for i in range(3))


def test_keep_without_clear_resumes_where_it_stood() -> None:
    core = engine()
    load(core, 3)
    core.execute_pass(0.0)
    effects = core.apply(Pause(PauseMode.KEEP, clear_cache=False), now_ms=0.0)
    assert effects.kv_events == []
    before = core.metrics()
    assert not core.execute_pass(0.0).progressed
    assert core.metrics() == before
    core.apply(Resume(), now_ms=0.0)
    result = core.execute_pass(0.0)
    assert [o.request_id for o in result.request_outputs()] == ["r0", "r1", "r2"]
    assert result.metrics.preemptions_total == 0


def test_a_resume_before_the_pause_completes_still_clears_when_idle() -> None:
    core = engine()
    load(core, 1)
    core.execute_pass(0.0)
    core.apply(Pause(PauseMode.WAIT), now_ms=0.0)
    core.apply(Resume(), now_ms=0.0)
    assert pause_gauges(core.metrics()) == (0, True, False)
    cleared = [
        any(isinstance(e, AllBlocksCleared) for e in core.execute_pass(0.0).kv_events)
        for _ in range(5)
    ]
    assert cleared == [False, False, False, True, False]
    assert pause_gauges(core.metrics()) == (0, False, False)


def test_sleep_puts_the_pools_away_once_the_pause_completes() -> None:
    core = engine()
    load(core, 1)
    core.execute_pass(0.0)
    core.apply(Sleep(level=2, mode=PauseMode.WAIT), now_ms=0.0)
    m = core.metrics()
    # Sleep is no user pause: it does not reject new requests.
    assert pause_gauges(m) == (1, True, False)
    assert sleep_gauges(m) == _AWAKE
    for _ in range(4):
        core.execute_pass(0.0)
    assert sleep_gauges(core.metrics()) == (("kv_cache", "weights"), True, 2)
    assert core.metrics().pause_pending is False


def test_sleep_level_zero_pauses_without_sleeping_a_pool() -> None:
    core = engine()
    load(core, 1)
    core.execute_pass(0.0)
    effects = core.apply(Sleep(level=0, mode=PauseMode.KEEP), now_ms=0.0)
    assert effects.kv_events == []  # level 0 keeps the cache
    assert sleep_gauges(core.metrics()) == ((), True, 0)
    assert core.metrics().running == 1
    # Fully awake already: "scheduling" resumes.
    core.apply(WakeUp(("scheduling",)), now_ms=0.0)
    assert pause_gauges(core.metrics()) == (0, False, False)
    assert sleep_gauges(core.metrics()) == _AWAKE


def test_wake_up_by_tags_resumes_only_once_fully_awake() -> None:
    core = engine()
    core.apply(Sleep(level=1), now_ms=0.0)
    assert sleep_gauges(core.metrics()) == (("kv_cache", "weights"), True, 1)
    # A tag that does not sleep wakes nothing (vLLM's executor warns and returns).
    core.apply(WakeUp(("weights", "lora")), now_ms=0.0)
    assert core.metrics().sleeping_tags == ("kv_cache", "weights")
    core.apply(WakeUp(("weights", "scheduling")), now_ms=0.0)
    m = core.metrics()
    assert (m.sleeping_tags, m.pause_state) == (("kv_cache",), 1)
    core.apply(WakeUp(("kv_cache",)), now_ms=0.0)
    m = core.metrics()
    assert (pause_gauges(m), sleep_gauges(m)) == ((0, False, False), _AWAKE)
    # An engine all back to defaults gauges as one never paused.
    assert m == engine().metrics()


def test_wake_up_with_no_tags_wakes_everything() -> None:
    core = engine()
    core.apply(Sleep(level=1), now_ms=0.0)
    core.apply(WakeUp(None), now_ms=0.0)
    m = core.metrics()
    assert (pause_gauges(m), sleep_gauges(m)) == ((0, False, False), _AWAKE)


@pytest.mark.parametrize("level", [-1, 3])
def test_a_sleep_level_outside_zero_to_two_is_refused(level: int) -> None:
    core = engine()
    with pytest.raises(InvalidRequestError, match="sleep level must be 0 to 2"):
        core.apply(Sleep(level=level), now_ms=0.0)
    assert pause_gauges(core.metrics()) == (0, False, False)


@pytest.mark.parametrize("cmd", [Pause(), Resume(), Sleep(), WakeUp()])
def test_mocker_semantics_refuse_pause_and_sleep(cmd: object) -> None:
    core = make_core(make_args(semantics=Semantics.MOCKER_1_3_0))
    with pytest.raises(UnsupportedError, match="vLLM semantics"):
        core.apply(cmd, now_ms=0.0)  # type: ignore[arg-type]


def test_async_keep_resolves_the_batch_in_flight_then_clears() -> None:
    """Async scheduling (a batch queue of 2): under `keep` no batch is scheduled, the one in
    flight still resolves (its tokens delivered), and the pause completes once none is left,
    as EngineCore's `has_work()` counts its batch queue."""
    core = Engine(
        msgspec.structs.replace(engine().args, async_scheduling=True).normalized(), record=True
    )
    load(core, 3)
    assert core.execute_pass(0.0).request_outputs() == []  # batch 1 scheduled
    second = core.execute_pass(0.0)  # batch 2 scheduled, batch 1 resolved
    assert [o.request_id for o in second.request_outputs()] == ["r0", "r1", "r2"]
    effects = core.apply(Pause(PauseMode.KEEP), now_ms=0.0)
    assert effects.kv_events == []
    assert pause_gauges(core.metrics()) == (2, True, False)
    last = core.execute_pass(0.0)  # no schedule: batch 2 resolves, then the clear
    assert last.trace is not None and last.trace.scheduled == []
    assert [o.request_id for o in last.request_outputs()] == ["r0", "r1", "r2"]
    assert [type(e) for e in last.kv_events][-1] is AllBlocksCleared
    assert last.trace.preempted == ["r2", "r1", "r0"]
    assert pause_gauges(last.metrics) == (2, False, False)
    assert not core.execute_pass(0.0).progressed
    core.apply(Resume(), now_ms=0.0)
    readmitted_from_nothing(core)


def test_async_reset_drops_the_output_in_flight_of_what_it_preempts() -> None:
    """vLLM's `drop_stale_output`: the batch in flight when a reset preempted r0-r2 resolves
    without delivering their tokens (they resume at once and sample those positions again),
    so the pass after the reset delivers nothing, and the next delivers one token each."""
    core = Engine(
        msgspec.structs.replace(engine().args, async_scheduling=True).normalized(), record=True
    )
    load(core, 3)
    core.execute_pass(0.0)
    second = core.execute_pass(0.0)  # batch 2 in flight, batch 1 resolved: token 1 each
    tokens = {o.request_id: o.new_token_ids for o in second.request_outputs()}
    assert core.apply(ResetPrefixCache(reset_running_requests=True), now_ms=0.0).result == APPLIED
    dropped = core.execute_pass(0.0)  # re-admits r0-r2, resolves batch 2: dropped
    assert dropped.request_outputs() == []
    assert [a.request_id for a in dropped.admissions] == ["r0", "r1", "r2"]
    again = core.execute_pass(0.0)
    assert [(o.request_id, len(o.new_token_ids)) for o in again.request_outputs()] == [
        ("r0", 1),
        ("r1", 1),
        ("r2", 1),
    ]
    assert all(len(tokens[f"r{i}"]) == 1 for i in range(3))


def test_abort_also_ends_the_destinations_not_yet_activated() -> None:
    """vLLM aborts its requests waiting for remote KV with the rest: a held destination
    (h1: 28 of the 31 usable blocks reserved) and a pending one (h2: 8 blocks, 3 free) end
    after the queued request, and the pause completes at the next pass instead of waiting
    for their transfers. Their handoffs are gone: activating h1 then changes nothing."""
    core = engine()
    held = core.apply(ReserveDestination("h1", request("d1", range(1, 113), 4)), now_ms=0.0)
    assert len(held.lifecycle_events) == 1
    pending = core.apply(ReserveDestination("h2", request("d2", range(201, 233), 4)), now_ms=0.0)
    assert pending.lifecycle_events == []
    load(core, 1)
    before = core.metrics()
    assert (before.waiting, before.active_blocks) == (3, 28)
    effects = core.apply(Pause(PauseMode.ABORT), now_ms=0.0)
    assert effects.ended == [
        EndedRequest("r0", FinishReason.CANCELLED),
        EndedRequest("d1", FinishReason.CANCELLED),
        EndedRequest("d2", FinishReason.CANCELLED),
    ]
    after = core.metrics()
    assert (after.waiting, after.active_blocks) == (0, 0)
    assert pause_gauges(after) == (1, True, True)
    done = core.execute_pass(0.0)
    assert pause_gauges(done.metrics) == (1, False, True)
    assert core.is_drained()
    assert core.apply(ActivateDestination("h1"), now_ms=0.0).result == NOOP
