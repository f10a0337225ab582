"""engined.server.ranks.pacer: the timerfd fires for deadlines past, present and future, re-arming
replaces the deadline, close releases the fd, and waiting does not spin the event loop.

No test waits on wall-clock intervals as synchronisation or asserts how long anything took:
futures resolving, fd counts and event-loop iteration counts are what they check.
"""

from __future__ import annotations

import asyncio
import math
import os
import selectors
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from engined.model_clock import ModelClock
from engined.server.ranks import pacer as pacer_mod
from engined.server.ranks.pacer import Pacer, SleepPacer, TimerfdPacer, open_pacer

linux_only = pytest.mark.skipif(
    pacer_mod._timerfd_backend() is None, reason="no timerfd on this platform"
)


class CountingSelector(selectors.DefaultSelector):
    """The event loop calls `select` once per iteration: this counts the iterations."""

    def __init__(self) -> None:
        super().__init__()
        self.selects = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        self.selects += 1
        return super().select(timeout)


def run(scenario: Callable[[], Awaitable[Any]]) -> Any:
    return asyncio.run(asyncio.wait_for(scenario(), 30))


def run_counting(scenario: Callable[[], Awaitable[Any]]) -> tuple[Any, CountingSelector]:
    """Run `scenario` on a selector event loop whose iterations are counted."""
    selector = CountingSelector()
    with asyncio.Runner(loop_factory=lambda: asyncio.SelectorEventLoop(selector)) as runner:
        return runner.run(asyncio.wait_for(scenario(), 30)), selector


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def timerfd_pacer() -> TimerfdPacer:
    pacer = open_pacer()
    assert isinstance(pacer, TimerfdPacer)
    return pacer


async def iterations_sleeping(pacer: Pacer, deadline: float) -> int:
    """Event-loop iterations (selector waits) spent in `pacer.sleep_until(deadline)`.

    Nothing else runs on the loop, so a pacer that yields until its deadline (sleep(0) in a
    loop) makes one iteration per yield, thousands in 50 ms; one that sleeps on a timer a
    handful. A count of iterations, not a measured interval.
    """
    selector = asyncio.get_running_loop()._selector  # type: ignore[attr-defined]
    assert isinstance(selector, CountingSelector)
    before = selector.selects
    await pacer.sleep_until(deadline)
    return int(selector.selects - before)


@linux_only
def test_fires_for_past_present_and_future_deadlines() -> None:
    async def scenario() -> None:
        pacer = await timerfd_pacer()
        try:
            now = time.monotonic()
            for deadline in (now - 10.0, 0.0, -5.0, now, time.monotonic(), now + 0.02):
                await pacer.sleep_until(deadline)
                assert time.monotonic() >= deadline - 1e-9  # never early (to float rounding)
        finally:
            pacer.close()

    run(scenario)


@linux_only
def test_rearming_replaces_the_previous_deadline() -> None:
    async def scenario() -> None:
        pacer = await timerfd_pacer()
        try:
            far = pacer.arm(time.monotonic() + 3600.0)
            for _ in range(10):
                await asyncio.sleep(0)
            assert not far.done()
            # The pending waiter is kept and resolves at the new deadline.
            sooner = pacer.arm(time.monotonic())
            assert sooner is far
            await asyncio.wait_for(sooner, 10)

            # A deadline that was already due is forgotten when re-armed for later, even
            # after epoll may have seen it: its expiry never reaches the later waiter.
            due = pacer.arm(time.monotonic() - 1.0)
            later = pacer.arm(time.monotonic() + 3600.0)
            assert later is due
            for _ in range(10):
                await asyncio.sleep(0)
            assert not later.done()
            await pacer.sleep_until(time.monotonic())
        finally:
            pacer.close()

    run(scenario)


@linux_only
def test_reuses_one_fd_and_close_releases_it() -> None:
    async def scenario() -> None:
        before = open_fds()
        pacer = await timerfd_pacer()
        fd = pacer.fd
        assert fd is not None
        assert open_fds() == before + 1
        for _ in range(50):
            await pacer.sleep_until(time.monotonic())
        assert pacer.fd == fd
        assert open_fds() == before + 1
        pacer.close()
        assert pacer.fd is None
        assert open_fds() == before
        pacer.close()  # idempotent
        with pytest.raises(RuntimeError):
            pacer.arm(time.monotonic())

    run(scenario)


@linux_only
def test_close_cancels_a_pending_waiter() -> None:
    async def scenario() -> None:
        pacer = await timerfd_pacer()
        sleeper = asyncio.create_task(pacer.sleep_until(time.monotonic() + 3600.0))
        await asyncio.sleep(0)
        pacer.close()
        with pytest.raises(asyncio.CancelledError):
            await sleeper

    run(scenario)


@linux_only
def test_a_cancelled_sleep_leaves_the_pacer_usable() -> None:
    async def scenario() -> None:
        pacer = await timerfd_pacer()
        try:
            sleeper = asyncio.create_task(pacer.sleep_until(time.monotonic() + 3600.0))
            await asyncio.sleep(0)
            sleeper.cancel()
            with pytest.raises(asyncio.CancelledError):
                await sleeper
            await pacer.sleep_until(time.monotonic())
        finally:
            pacer.close()

    run(scenario)


@linux_only
def test_waiting_does_not_spin_the_event_loop() -> None:
    async def scenario() -> int:
        pacer = await timerfd_pacer()
        try:
            return await iterations_sleeping(pacer, time.monotonic() + 0.05)
        finally:
            pacer.close()

    iterations, _ = run_counting(scenario)
    assert iterations < 100


def test_the_fallback_does_not_spin_either() -> None:
    async def scenario() -> int:
        return await iterations_sleeping(SleepPacer(), time.monotonic() + 0.05)

    iterations, _ = run_counting(scenario)
    assert iterations < 100


def test_the_counting_detects_a_spin() -> None:
    """The counter itself: a pacer that yields its way to the deadline is caught (this one
    yields a fixed 1,000 times, so the check does not depend on how fast the machine is)."""

    class Spinning:
        async def sleep_until(self, deadline: float) -> None:
            for _ in range(1000):
                await asyncio.sleep(0)

        def close(self) -> None:
            pass

    async def scenario() -> int:
        return await iterations_sleeping(Spinning(), time.monotonic() + 0.05)

    iterations, _ = run_counting(scenario)
    assert iterations >= 1000


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_deadlines_are_refused(bad: float) -> None:
    async def scenario() -> None:
        pacers: list[Any] = [SleepPacer(), open_pacer()]
        try:
            for pacer in pacers:
                with pytest.raises(ValueError, match="finite"):
                    await pacer.sleep_until(bad)
                await pacer.sleep_until(time.monotonic())  # still usable
        finally:
            for pacer in pacers:
                pacer.close()

    run(scenario)


def test_a_custom_clock_gets_the_fallback() -> None:
    """The kernel timer only knows CLOCK_MONOTONIC; another clock's deadlines mean nothing
    to it, so any other clock sleeps on the event loop's timers."""
    ticks = iter(range(1_000_000))

    def clock() -> float:
        return float(next(ticks))

    async def scenario() -> None:
        pacer = open_pacer(clock)
        assert isinstance(pacer, SleepPacer)
        await pacer.sleep_until(-1.0)  # in the past for this clock: returns at once
        pacer.close()

    run(scenario)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="CLOCK_MONOTONIC is Linux's")
def test_time_monotonic_is_the_timerfd_clock() -> None:
    assert time.get_clock_info("monotonic").implementation == "clock_gettime(CLOCK_MONOTONIC)"
    assert abs(time.clock_gettime(time.CLOCK_MONOTONIC) - time.monotonic()) < 1.0


@linux_only
def test_a_paced_engine_loop_sleeps_on_one_timerfd_and_closes_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The daemon's path: the default clock paces on a timerfd, opened at the first wait that
    is not late, reused for every later pass, and closed by `run` at the end.

    At speedup 1 these passes are modeled at 17-34 ms, so the loop would have to stall that
    long on every one of the 8 passes for none of them to wait.
    """
    from engined.core.args import EngineArgs
    from engined.core.engine import Engine
    from engined.core.types import Request, Submit
    from engined.server.ranks import pacer as pacer_module
    from engined.server.ranks.engine_loop import EngineLoop

    created: list[Pacer] = []

    def recording_open_pacer(clock: Callable[[], float] = time.monotonic) -> Pacer:
        pacer = open_pacer(clock)
        created.append(pacer)
        return pacer

    monkeypatch.setattr(pacer_module, "open_pacer", recording_open_pacer)

    class Sinks:
        overflows = 0

        def publish(self, *args: Any) -> None:
            pass

        def maybe_heartbeat(self, now: float) -> None:
            pass

        def deliver_outputs(self, rank: int, outputs: list[Any], decodes: Any) -> None:
            pass

        def deliver_lifecycle(self, rank: int, events: list[Any]) -> None:
            pass

    async def scenario() -> None:
        engine = EngineArgs(block_size=16, num_gpu_blocks=64, speedup_ratio=1.0).normalized()
        sinks = Sinks()
        loop = EngineLoop(
            Engine(engine), kv=sinks, fpm=sinks, delivery=sinks, model_clock=ModelClock(1.0)
        )
        before = open_fds()
        runner = asyncio.create_task(loop.run())
        await asyncio.gather(
            *(
                loop.call(Submit(Request(token_ids=list(range(n, n + 64)), max_tokens=8)))
                for n in range(3)
            )
        )
        loop.stop()  # ends once the core is empty
        await runner
        assert loop.passes_total > 1
        assert len(created) == 1
        pacer = created[0]
        assert isinstance(pacer, TimerfdPacer)
        assert pacer.fd is None
        assert loop._timers.pacer is None
        assert open_fds() == before

    run(scenario)
