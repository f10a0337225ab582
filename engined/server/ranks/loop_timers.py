"""How a rank's loop waits: for a pass's modeled end, and for a command or a deadline.

A test injects a `sleep` (a virtual clock's) and every wait goes through it. Otherwise a
paced wait that must be on time (a pass's end, a tier-transfer deadline) sleeps on an
`engined.server.ranks.pacer` (a timerfd on Linux), opened on first use on the event loop that runs
the passes and reused for every later wait (one per rank, re-armed each time); `close`
releases it when the loop ends. Any other wait is asyncio's, which may wake up to 1 ms late.

NOTE: the selector returns at the deadline, but the pass still starts behind what the event
loop already holds (other ranks' due passes, at most one control turn, see
engined.server.control.control_reader, and the handlers it spawned), then the rank's inbox turn. A
kernel wake-up costs ~0.05-0.1 ms that the old sleep(0) spin did not.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from engined.server.ranks import pacer as pacers
from engined.server.ranks.rank_sinks import Sleep


class Wake:
    """A rank's wake-up flag: asyncio.Event's `set`, `clear`, `is_set` and `wait`, for its one
    waiter, the rank's loop. `set` also resolves the future a paced wait is parked on, so
    "until a command comes or the pass ends" is one future on the pacer's timer: with an
    Event it took two tasks, an `asyncio.wait` and two cancellations, every pass.
    """

    __slots__ = ("_flag", "_parked")

    def __init__(self) -> None:
        self._flag = False
        self._parked: asyncio.Future[None] | None = None

    def is_set(self) -> bool:
        return self._flag

    def clear(self) -> None:
        self._flag = False

    def set(self) -> None:
        self._flag = True
        parked = self._parked
        if parked is not None and not parked.done():
            parked.set_result(None)

    async def wait(self) -> None:
        if not self._flag:
            await self.parked(asyncio.get_running_loop().create_future())

    async def parked(self, future: asyncio.Future[None]) -> None:
        """Await `future`, which `set` resolves too (if nothing else has by then)."""
        self._parked = future
        try:
            await future
        finally:
            if self._parked is future:
                self._parked = None


class LoopTimers:
    def __init__(self, clock: Callable[[], float], sleep: Sleep | None, *, paced: bool) -> None:
        self._clock = clock
        self._sleep = sleep
        self._paced = paced
        self.pacer: pacers.Pacer | None = None

    async def sleep_until(self, deadline: float) -> None:
        """Until `clock()` reaches `deadline` (seconds of the loop's clock), without spinning."""
        if self._sleep is not None:
            await self._sleep(deadline - self._clock())
        else:
            await self._opened_pacer().sleep_until(deadline)

    async def wait_event(self, event: Wake, timeout: float, *, precise: bool) -> bool:
        """Whether `event` was set within `timeout` seconds of the loop's clock. `precise`
        (a pass's end, a tier-transfer deadline; paced): on the pacer's timer."""
        timed: Awaitable[None]
        if self._sleep is not None:
            timed = self._sleep(timeout)
        elif precise and self._paced:
            pacer = self._opened_pacer()
            if isinstance(pacer, pacers.TimerfdPacer):
                if not event.is_set():
                    await event.parked(pacer.arm(self._clock() + timeout))
                return event.is_set()
            timed = pacer.sleep_until(self._clock() + timeout)
        else:
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                return False
            return True
        waiter = asyncio.ensure_future(event.wait())
        timer = asyncio.ensure_future(timed)
        try:
            await asyncio.wait((waiter, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            timer.cancel()
        return event.is_set()

    def close(self) -> None:
        pacer, self.pacer = self.pacer, None
        if pacer is not None:
            pacer.close()

    def _opened_pacer(self) -> pacers.Pacer:
        pacer = self.pacer
        if pacer is None:
            pacer = self.pacer = pacers.open_pacer(self._clock)
        return pacer
