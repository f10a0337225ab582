"""Paced passes keep their absolute schedule (engined/server/ranks/engine_loop.py `_core_ms`).

While requests run back to back, a pass starts for the core at the previous pass's modeled
end, however late it actually ran, so the pass after a late one waits less (or not at all)
and the schedule holds; the schedule trails the clock by at most CATCH_UP_S; after idle, a
pass starts at the actual time. Time is a manual clock (tests/server/virtual_clock.py): the
loop sleeps to each deadline, and the test wakes it exactly on time or late by moving the
clock, as a run queue would. Passes only decode, 5 ms each.
"""

from __future__ import annotations

import asyncio
import contextlib

from engined.core.command_report import CommandReport
from engined.core.pass_report import PassReport
from engined.core.types import (
    Cancel,
    Command,
    Decodes,
    LifecycleEvent,
    RequestOutput,
    Submit,
)
from engined.core.types import Request as CoreRequest
from engined.server.ranks.collector import Collector
from engined.server.ranks.deadlines import Deadlines
from engined.server.ranks.engine_loop import CATCH_UP_S, EngineLoop
from engined.server.ranks.rank_build import Pacing
from tests.server.inprocess import engine_loop
from tests.server.virtual_clock import ManualClock
from tests.support import run, until


class Timeline:
    """What the loop did, in ms: each pass's start for the core and the clock when it ran,
    when a request's tokens were delivered, and the arrival each command was applied with."""

    def __init__(self, clock: ManualClock) -> None:
        self.clock = clock
        self.starts: list[float] = []
        self.ran_at: list[float] = []
        self.delivered: list[float] = []
        self.arrivals: list[tuple[str, float]] = []
        self.finished: set[str] = set()

    def now(self) -> float:
        return round(self.clock() * 1000, 3)

    def on_pass(self, rank: int, start_ms: float, result: PassReport) -> None:
        self.starts.append(round(start_ms, 3))
        self.ran_at.append(self.now())

    def on_command(self, rank: int, at: float, command: Command, report: CommandReport) -> None:
        if isinstance(command, Submit):
            self.arrivals.append((command.request.request_id or "?", round(at, 3)))

    def deliver_outputs(self, rank: int, outputs: list[RequestOutput], decodes: Decodes) -> None:
        self.delivered.append(self.now())
        self.finished.update(o.request_id for o in outputs if o.finish_reason is not None)

    def deliver_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None:
        pass


def submit(request_id: str, max_tokens: int) -> Submit:
    return Submit(CoreRequest(token_ids=[1, 2, 3, 4], max_tokens=max_tokens, request_id=request_id))


async def started(clock: ManualClock) -> tuple[EngineLoop, Timeline, asyncio.Future[None]]:
    timeline = Timeline(clock)
    loop = engine_loop(
        timeline,
        clock=clock,
        sleep=clock.sleep,
        pacing=Pacing(Deadlines(), Collector(Deadlines(), clock=clock)),
        speedup_ratio=1.0,
        fixed_decode_ms_per_pass=5.0,
    )
    loop.pass_observers.append(timeline.on_pass)
    loop.command_observers.append(timeline.on_command)
    return loop, timeline, asyncio.ensure_future(loop.run())


async def wake_at(clock: ManualClock, timeline: Timeline, ms: float, passes: int) -> None:
    """Move the clock to `ms` and wait until `passes` passes have run in all."""
    clock.advance_to(ms / 1000)
    await until(lambda: len(timeline.starts) == passes, f"pass {passes} at {ms} ms")


async def stopped(task: asyncio.Future[None]) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_a_late_pass_is_caught_up_by_the_next_one() -> None:
    """The pass due at 10 ms runs at 12 (woken 2 ms late): it still starts at 10 for the core
    and ends at 15, so the next pass waits only 3 ms and every later one is on the 5 ms grid.
    Tokens leave at 5, 12, 15 and 20: the client's gaps (7, 3, 5) average the modelled pass.
    Before, every pass from then on ran 2 ms behind (12, 17, 22), and so did its tokens."""

    async def scenario() -> None:
        clock = ManualClock()
        loop, timeline, task = await started(clock)
        loop.send(submit("long", 100))
        await until(lambda: timeline.starts == [0.0], "the first pass")
        await wake_at(clock, timeline, 5.0, 2)
        await wake_at(clock, timeline, 12.0, 3)  # due at 10
        await wake_at(clock, timeline, 15.0, 4)
        await wake_at(clock, timeline, 20.0, 5)
        assert timeline.starts == [0.0, 5.0, 10.0, 15.0, 20.0]
        assert timeline.ran_at == [0.0, 5.0, 12.0, 15.0, 20.0]
        assert timeline.delivered == [5.0, 12.0, 15.0, 20.0]
        # When each pass actually ran against its planned start (not its start for the core).
        assert list(loop.lateness.ms) == [0.0, 2.0, 0.0, 0.0]
        await stopped(task)

    run(scenario())


def test_passes_that_fell_behind_run_back_to_back_until_on_schedule() -> None:
    """Woken at 19 ms for a pass due at 10: the passes of 10 and 15 ms run at once (their
    modeled ends are past), and the one of 20 ms waits for its time again."""

    async def scenario() -> None:
        clock = ManualClock()
        loop, timeline, task = await started(clock)
        loop.send(submit("long", 100))
        await until(lambda: timeline.starts == [0.0], "the first pass")
        await wake_at(clock, timeline, 5.0, 2)
        await wake_at(clock, timeline, 19.0, 4)
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(timeline.starts) == 4, "the pass of 20 ms waits for 20 ms"
        await wake_at(clock, timeline, 20.0, 5)
        assert timeline.starts == [0.0, 5.0, 10.0, 15.0, 20.0]
        assert timeline.ran_at == [0.0, 5.0, 19.0, 19.0, 20.0]
        assert list(loop.lateness.ms) == [0.0, 9.0, 4.0, 0.0]
        await stopped(task)

    run(scenario())


def test_the_schedule_trails_the_clock_by_at_most_the_bound() -> None:
    """Stalled from 10 ms to 1 s: the schedule restarts CATCH_UP_S (50 ms) behind, at 950 ms,
    and catches up those 50 ms in 10 back-to-back passes (950 to 995); the pass of 1,000 ms
    is on time. The 940 ms of passes beyond the bound are not run."""
    assert CATCH_UP_S == 0.05

    async def scenario() -> None:
        clock = ManualClock()
        loop, timeline, task = await started(clock)
        loop.send(submit("long", 100))
        await until(lambda: timeline.starts == [0.0], "the first pass")
        await wake_at(clock, timeline, 5.0, 2)
        await wake_at(clock, timeline, 1000.0, 13)
        for _ in range(20):
            await asyncio.sleep(0)
        assert len(timeline.starts) == 13, "the pass of 1,005 ms waits for its time"
        behind = [950.0 + 5.0 * k for k in range(11)]
        assert timeline.starts == [0.0, 5.0, *behind]
        assert timeline.ran_at == [0.0, 5.0] + [1000.0] * 11
        # Lateness is when they ran against their planned starts: 990 ms for the first.
        assert list(loop.lateness.ms) == [0.0, 990.0] + [1000.0 - s for s in behind[1:]]
        await stopped(task)

    run(scenario())


def test_idle_resets_the_schedule() -> None:
    """A request ends at 10 ms and the rank waits for work; the next one arrives at 37.5 ms
    and its pass starts then, not on the old 5 ms grid, with no lateness recorded for it."""

    async def scenario() -> None:
        clock = ManualClock()
        loop, timeline, task = await started(clock)
        loop.send(submit("first", 2))
        await until(lambda: timeline.starts == [0.0], "the first pass")
        await wake_at(clock, timeline, 5.0, 2)
        clock.advance_to(0.010)
        await until(lambda: "first" in timeline.finished, "the first request ended")
        await loop.until_idle()
        clock.advance_to(0.0375)
        loop.send(submit("second", 2))
        await until(lambda: len(timeline.starts) == 3, "the second request's pass")
        await wake_at(clock, timeline, 42.5, 4)
        assert timeline.starts == [0.0, 5.0, 37.5, 42.5]
        assert timeline.arrivals == [("first", 0.0), ("second", 37.5)]
        assert list(loop.lateness.ms) == [0.0, 0.0]
        await stopped(task)

    run(scenario())


def test_a_command_applied_while_catching_up_arrives_at_the_schedule() -> None:
    """A cancel holds the boundary, so a submission behind it, sent at 11 ms while the pass due
    at 10 runs late, is applied at that boundary, at 10 ms for the core: the core's clock
    never goes back, and its arrival counts as 10 ms, not after the pass that admits it."""

    async def scenario() -> None:
        clock = ManualClock()
        loop, timeline, task = await started(clock)
        loop.send(submit("long", 100))
        loop.send(submit("victim", 100))
        await until(lambda: timeline.starts == [0.0], "the first pass")
        await wake_at(clock, timeline, 5.0, 2)
        clock.advance_to(0.011)
        loop.send(Cancel("victim"))
        loop.send(submit("late", 100))
        await until(lambda: len(timeline.starts) == 3, "the pass due at 10 ms")
        assert timeline.starts == [0.0, 5.0, 10.0]
        assert timeline.ran_at == [0.0, 5.0, 11.0]
        assert timeline.arrivals == [("long", 0.0), ("victim", 0.0), ("late", 10.0)]
        await stopped(task)

    run(scenario())
