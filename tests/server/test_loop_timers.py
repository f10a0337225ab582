"""A rank's paced wait for "a command or the pass's end" (engined.server.ranks.loop_timers):
one future on the pacer's timerfd, resolved by whichever comes first."""

from __future__ import annotations

import asyncio
import time

from engined.server.ranks.loop_timers import LoopTimers, Wake
from tests.server.test_pacer import linux_only, run


@linux_only
def test_a_wake_ends_a_long_paced_wait_with_true() -> None:
    async def scenario() -> bool:
        timers = LoopTimers(time.monotonic, None, paced=True)
        wake = Wake()
        asyncio.get_running_loop().call_soon(wake.set)
        try:
            # Not woken, this would outlive run()'s 30 s bound and fail.
            return await timers.wait_event(wake, 3600.0, precise=True)
        finally:
            timers.close()

    assert run(scenario) is True


@linux_only
def test_an_unwoken_paced_wait_ends_at_its_deadline_with_false() -> None:
    async def scenario() -> None:
        timers = LoopTimers(time.monotonic, None, paced=True)
        wake = Wake()
        try:
            deadline = time.monotonic() + 0.01
            assert await timers.wait_event(wake, 0.01, precise=True) is False
            assert time.monotonic() >= deadline - 1e-9  # never early
        finally:
            timers.close()

    run(scenario)


@linux_only
def test_a_wait_after_a_woken_one_is_not_ended_by_the_older_deadline() -> None:
    async def scenario() -> None:
        timers = LoopTimers(time.monotonic, None, paced=True)
        wake = Wake()
        try:
            asyncio.get_running_loop().call_soon(wake.set)
            assert await timers.wait_event(wake, 0.005, precise=True) is True
            wake.clear()
            deadline = time.monotonic() + 0.05
            assert await timers.wait_event(wake, 0.05, precise=True) is False
            assert time.monotonic() >= deadline - 1e-9
            assert timers.pacer is not None and timers.pacer.fd is not None  # type: ignore[attr-defined]
        finally:
            timers.close()

    run(scenario)


@linux_only
def test_a_wake_set_before_the_wait_returns_true_at_once() -> None:
    async def scenario() -> bool:
        timers = LoopTimers(time.monotonic, None, paced=True)
        wake = Wake()
        wake.set()
        try:
            return await timers.wait_event(wake, 3600.0, precise=True)
        finally:
            timers.close()

    assert run(scenario) is True


def test_wake_wait_returns_once_set_and_at_once_while_set() -> None:
    async def scenario() -> None:
        wake = Wake()
        asyncio.get_running_loop().call_soon(wake.set)
        await asyncio.wait_for(wake.wait(), 30)
        assert wake.is_set()
        await wake.wait()
        wake.clear()
        assert not wake.is_set()
        try:
            await asyncio.wait_for(wake.wait(), 0.001)
        except TimeoutError:
            pass
        else:
            raise AssertionError("a cleared wake that nobody sets must not return")

    asyncio.run(scenario())
