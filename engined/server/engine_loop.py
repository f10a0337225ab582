"""The live pass loop of one data-parallel rank.

One task per rank owns its core exclusively. Commands reach it through an inbox and are
applied between passes, so a command never sees half a pass and nothing needs a lock; the
reply goes out when the command is applied. Each pass then runs in this order:

1. `execute_pass(now_ms)`; the KV batch is published at once (vLLM publishes at pass start),
2. wait until the pass's modeled end (an absolute deadline, so pacing never drifts; with
   `speedup_ratio == 0` there is no waiting and the clock is virtual),
3. outputs (one message per client), the FPM snapshot, lifecycle events.

Every pass yields to the event loop at least once, even when the rank runs late and its
deadline has already passed: the control socket, the other ranks, the publishers, HTTP,
signals and the systemd watchdog all share this thread, and a rank that never awaited would
starve them for as long as it stayed behind.

A rank with nothing to do sleeps on its wake event (publishing an FPM heartbeat each second);
a pass that changed nothing also waits for the next command instead of spinning. With offload
tiers, such a rank also wakes at the earliest tier-transfer deadline (paced: sleeps until it;
speedup 0: moves the virtual clock to it): a busy core then runs a pass, an empty one ticks
its tiers (`tick_offload_only`) and publishes what landed.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog

from engined.core.errors import CoreError
from engined.core.scheduler import VllmCore
from engined.core.types import (
    Command,
    CommandEffects,
    EngineMetrics,
    LifecycleEvent,
    OutputSignal,
    PassResult,
)

log = structlog.get_logger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
# Lead before a pass deadline where the loop stops sleeping and yields until the deadline.
PRECISE_WAKE_S = 0.0015
# Pass-start lateness percentiles are re-sorted at most this often (seconds of `clock`), so a
# client polling `stats` costs a sort of the window per interval, not per message.
LATENESS_SUMMARY_TTL_S = 0.1

Sleep = Callable[[float], Awaitable[None]]


class KvSink(Protocol):
    def publish(self, events: list[Any], ts: float) -> None: ...

    @property
    def overflows(self) -> int: ...


class FpmSink(Protocol):
    def publish(self, snapshot: Any) -> None: ...

    def maybe_heartbeat(self, now: float) -> None: ...


class Delivery(Protocol):
    """Where a rank's results go: the control server routes them to clients."""

    def deliver_outputs(self, rank: int, signals: list[OutputSignal]) -> None: ...

    def deliver_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None: ...


Job = Callable[[VllmCore], None]
# Told of every pass that changed something, right after it ran: (rank, pass start ms, result).
# Before pacing, so no await separates the core's new state from what observers saw, and their
# work fits in the pass's modeled time. Prometheus metrics (engined.server.metrics) are one.
PassObserver = Callable[[int, float, PassResult], None]
# Told of every command applied without error: (rank, ms when `call` was made, command, effects).
CommandObserver = Callable[[int, float, Command, CommandEffects], None]


class EngineLoop:
    """Runs passes for one rank and applies its commands between them."""

    def __init__(
        self,
        core: VllmCore,
        *,
        kv: KvSink,
        fpm: FpmSink,
        delivery: Delivery,
        speedup_ratio: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep | None = None,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock` (seconds) and `sleep` (waits that many seconds of `clock`) are the loop's
        time; the defaults are the monotonic clock and the event loop's timers, and a test
        passes a virtual clock and its sleep to run paced passes without waiting. A custom
        `clock` without a `sleep` keeps the event loop's timers (and their precision wait).
        """
        self.core = core
        self.rank = core.dp_rank
        self._kv = kv
        self._fpm = fpm
        self._delivery = delivery
        self._paced = speedup_ratio > 0
        self._clock = clock
        self._sleep = sleep
        self._wall_clock = wall_clock
        self._inbox: deque[Job] = deque()
        self._wake = asyncio.Event()
        self._start = clock()
        self._virtual_ms = 0.0
        self._stopped = False
        self.passes_total = 0
        self.tokens_total = 0
        # How late each pass started against its planned start, in ms (paced mode only).
        self.lateness_ms: deque[float] = deque(maxlen=100_000)
        self._lateness_summary: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._lateness_at: tuple[int, float] | None = None  # (passes_total, clock) of it
        self._next_start: float | None = None
        self.pass_observers: list[PassObserver] = []
        self.command_observers: list[CommandObserver] = []

    @property
    def kv_overflows(self) -> int:
        """KV event sends some slow subscriber missed (its queue's byte budget was full)."""
        return self._kv.overflows

    def lateness_summary(self) -> tuple[float, float, float]:
        """p50, p99 and max of pass-start lateness in ms (zeros before any paced pass).

        Exact when no pass ran since the last call; otherwise at most LATENESS_SUMMARY_TTL_S
        old, since sorting the 100,000-pass window costs ~10 ms and `stats` is a cheap message.
        """
        now = self._clock()
        cached = self._lateness_at
        if cached is not None and (
            cached[0] == self.passes_total or now - cached[1] < LATENESS_SUMMARY_TTL_S
        ):
            return self._lateness_summary
        self._lateness_at = (self.passes_total, now)
        if not self.lateness_ms:
            self._lateness_summary = (0.0, 0.0, 0.0)
        else:
            ordered = sorted(self.lateness_ms)
            n = len(ordered)
            self._lateness_summary = (
                ordered[n // 2],
                ordered[min(n - 1, (99 * n) // 100)],
                ordered[-1],
            )
        return self._lateness_summary

    # --- commands -----------------------------------------------------------------------

    @property
    def queued(self) -> int:
        return len(self._inbox)

    def post(self, job: Job) -> None:
        """Run `job(core)` at the next pass boundary."""
        self._inbox.append(job)
        self._wake.set()

    async def call(self, command: Command) -> CommandEffects:
        """Apply a command at the next boundary; raises its CoreError if it failed."""
        future: asyncio.Future[CommandEffects] = asyncio.get_running_loop().create_future()
        called_ms = self.now_ms()

        def job(core: VllmCore) -> None:
            try:
                # An offload the command causes starts when the command is applied.
                effects = core.apply_live_command(command, True, self.now_ms())
            except CoreError as exc:
                future.set_exception(exc)
                return
            for observer in self.command_observers:
                observer(self.rank, called_ms, command, effects)
            future.set_result(effects)
            if effects.lifecycle_events:
                self._delivery.deliver_lifecycle(self.rank, effects.lifecycle_events)

        self.post(job)
        return await future

    def stop(self) -> None:
        """End the loop once its core is empty and its inbox drained."""
        self._stopped = True
        self._wake.set()

    # --- the loop -----------------------------------------------------------------------

    def now_ms(self) -> float:
        if self._paced:
            return (self._clock() - self._start) * 1000.0
        return self._virtual_ms

    async def run(self) -> None:
        core = self.core
        progressed = True
        while True:
            if not self._inbox and (core.is_empty() or not progressed):
                if self._stopped and core.is_empty():
                    return
                await self._wait_for_work()
                progressed = True
            self._drain_inbox()
            if core.is_empty():
                self._tick_offload()
                continue
            before = core.metrics()
            start_ms = self.now_ms()
            result = self._execute(start_ms)
            progressed = self._progressed(result, before)
            if not progressed:
                continue
            for observer in self.pass_observers:
                observer(self.rank, start_ms, result)
            await self._pace(result.end_ms)
            self._publish(result)

    def _execute(self, now_ms: float) -> PassResult:
        if self._next_start is not None:
            self.lateness_ms.append(max(now_ms - self._next_start, 0.0))
        result = self.core.execute_pass(now_ms)
        self.passes_total += 1
        if result.kv_events:
            self._kv.publish(result.kv_events, self._wall_clock())
        return result

    @staticmethod
    def _progressed(result: PassResult, before: EngineMetrics) -> bool:
        """Whether a pass changed anything; a pass that did not waits for the next command."""
        return bool(
            result.output_signals
            or result.admissions
            or result.kv_events
            or result.lifecycle_events
            or result.completed_requests
            or result.fpm.wall_time_secs > 0
            or result.metrics != before
        )

    async def _pace(self, end_ms: float) -> None:
        """Wait for the pass's modeled end; always yields at least once (see the module doc)."""
        if not self._paced:
            self._virtual_ms = max(self._virtual_ms, end_ms)
            await asyncio.sleep(0)
            return
        self._next_start = end_ms
        delay = (end_ms - self.now_ms()) / 1000.0
        if delay <= 0:
            # Late: no waiting, but the rest of the daemon gets its turn before the next pass.
            await asyncio.sleep(0)
        elif self._sleep is not None:
            await self._sleep(delay)
        else:
            await self._precise_sleep(self._start + end_ms / 1000.0)

    async def _precise_sleep(self, deadline: float) -> None:
        """Sleep on the event loop's timers until `clock()` reaches `deadline`.

        NOTE: epoll rounds timeouts up to whole milliseconds, so a plain sleep wakes up to
        1 ms late. The timer is set PRECISE_WAKE_S early and the rest is yielded away: only
        that last stretch (under 1.5 ms) re-polls, and other tasks run while it does. A rank
        that is on time spends it; a late one never gets here.
        """
        clock = self._clock
        delay = deadline - clock() - PRECISE_WAKE_S
        if delay > 0:
            await asyncio.sleep(delay)
        while clock() < deadline:
            await asyncio.sleep(0)

    def _publish(self, result: PassResult) -> None:
        if result.output_signals:
            self.tokens_total += len(result.output_signals)
            self._delivery.deliver_outputs(self.rank, result.output_signals)
        self._fpm.publish(result.fpm)
        lifecycle = result.lifecycle_events + self.core.retry_pending_destinations()
        if lifecycle:
            self._delivery.deliver_lifecycle(self.rank, lifecycle)

    def _drain_inbox(self) -> None:
        inbox = self._inbox
        core = self.core
        while inbox:
            inbox.popleft()(core)
        # Commands may have freed capacity without a pass (e.g. a released source).
        events = core.retry_pending_destinations()
        if events:
            self._delivery.deliver_lifecycle(self.rank, events)
        # KV events of commands (reset_prefix_cache's AllBlocksCleared) ride on the next pass;
        # an empty core runs none, so it publishes them now rather than at the next request.
        if core.is_empty():
            kv_events = core.take_kv_events()
            if kv_events:
                self._kv.publish(kv_events, self._wall_clock())

    async def _wait_for_work(self) -> None:
        """Sleep until a command arrives or a tier transfer is due, with FPM heartbeats."""
        self._next_start = None
        wake = self._wake
        while not wake.is_set():
            timeout = HEARTBEAT_INTERVAL_S
            due_in = self._offload_due_in()
            if due_in is not None:
                if due_in <= 0:
                    await asyncio.sleep(0)  # due now: still let commands and other ranks in
                    break
                timeout = min(timeout, due_in)
            if not await self._wait_event(wake, timeout):
                self._fpm.maybe_heartbeat(self._clock())
        wake.clear()

    async def _wait_event(self, event: asyncio.Event, timeout: float) -> bool:
        """Whether `event` was set within `timeout` seconds of the loop's clock."""
        if self._sleep is None:
            try:
                await asyncio.wait_for(event.wait(), timeout)
            except TimeoutError:
                return False
            return True
        waiter = asyncio.ensure_future(event.wait())
        timer = asyncio.ensure_future(self._sleep(timeout))
        try:
            await asyncio.wait((waiter, timer), return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            timer.cancel()
        return event.is_set()

    def _offload_due_in(self) -> float | None:
        """Seconds until the core's next tier-transfer deadline (None: no transfer).

        Measured with `now_ms`, as `_tick_offload` is, so "due" means the same to both. At
        speedup 0 nothing waits for time: the virtual clock moves to the deadline.
        """
        deadline_ms = self.core.earliest_offload_deadline()
        if deadline_ms is None:
            return None
        if not self._paced:
            self._virtual_ms = max(self._virtual_ms, deadline_ms)
            return 0.0
        return (deadline_ms - self.now_ms()) / 1000.0

    def _tick_offload(self) -> None:
        """Land the tier transfers due by now on an empty core and publish their events."""
        core = self.core
        deadline_ms = core.earliest_offload_deadline()
        now_ms = self.now_ms()
        if deadline_ms is None or now_ms < deadline_ms:
            return
        effects = core.tick_offload_only(now_ms)
        if effects.kv_events:
            self._kv.publish(effects.kv_events, self._wall_clock())
        if effects.lifecycle_events:
            self._delivery.deliver_lifecycle(self.rank, effects.lifecycle_events)
