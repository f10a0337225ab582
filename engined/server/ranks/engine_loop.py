"""The live pass loop of one data-parallel rank.

One task per rank owns its core exclusively. Commands reach it through an inbox and are
applied between passes (or while a pass that has run is paced), so a command never sees half
a pass and nothing needs a lock; the reply goes out when the command is applied. Each pass
then runs in this order:

1. `execute_pass(start_ms)`; the KV batch is published at once (vLLM publishes at pass start),
2. wait until the pass's modeled end (an absolute deadline, so pacing never drifts; with
   `speedup_ratio == 0` there is no waiting and the clock is virtual); submissions that
   arrive meanwhile are applied as they come (`_pace`), not at the deadline,
3. outputs (one message per client), the FPM snapshot, lifecycle events.

Paced, passes keep their absolute schedule while requests run back to back: a pass starts,
for the core, at the modeled end of the one before (`_core_ms`), not at the moment it
actually ran, so a pass that started late is followed by a shorter wait, or none, until the
schedule is met again, and a streaming client sees the modeled pass, not the pass plus its
lateness. The schedule trails the clock by at most CATCH_UP_S: past that (a daemon stalled
for seconds) the passes missed are given up rather than run in a burst. After idle the next
pass starts at the actual time. The core's clock never runs backwards and never runs ahead
of the loop's: commands are applied at the same schedule time, and a command applied before
it arrived by that time counts as arriving when applied.

Every pass yields to the event loop at least once, even when the rank runs late and its
deadline has already passed: the control socket, the other ranks, the publishers, HTTP,
signals and the systemd watchdog all share this thread, and a rank that never awaited would
starve them for as long as it stayed behind.

A rank with nothing to do sleeps on its wake event (publishing an FPM heartbeat each second);
a pass that changed nothing also waits for the next command instead of spinning. With offload
tiers, such a rank also wakes at the earliest tier-transfer deadline (paced: sleeps until it;
speedup 0: moves the virtual clock to it): a busy core then runs a pass, an empty one ticks
its tiers (`Engine.advance_tiers`) and publishes what landed.

The core's clock is modelled time at every speedup: paced, the loop gives it the loop's clock
mapped through its `ModelClock` (engined.model_clock), and maps the core's pass ends and tier
deadlines back to deadlines of the loop's clock the same way; unpaced, a virtual clock. The
forward-pass metric's `wall_time` stays wall time on the wire (`ModelClock.reported_s`).

The loop reads only what the engine returns (`CommandEffects`, `PassResult`, `TierAdvance`)
and its public gauges, and tells its pass observers a `PassReport`; commands are
`engined.core` commands, applied through the inbox by `call` (the caller awaits the
command's `CommandReport`) or `send` (fire and forget, e.g. a cancel for a vanished client).
Either way the command observers see the report, so every request that ends is seen ending.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import msgspec
import structlog

from engined.core.command_report import CommandReport
from engined.core.engine import Engine
from engined.core.pass_report import PassReport
from engined.core.types import Command, PassResult
from engined.model_clock import ModelClock
from engined.server.ranks.collector import Collector
from engined.server.ranks.deadlines import Deadlines
from engined.server.ranks.lateness import LatenessWindow
from engined.server.ranks.loop_timers import LoopTimers, Wake
from engined.server.ranks.rank_gauges import RankGauges
from engined.server.ranks.rank_inbox import EARLY_MARGIN_S, RankInbox
from engined.server.ranks.rank_sinks import (
    CommandObserver,
    Delivery,
    FpmSink,
    KvSink,
    PassObserver,
    Sleep,
)

log = structlog.get_logger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
# Paced: how far (seconds of the loop's clock) the schedule of back-to-back passes may trail
# it. Lateness up to this is caught up by later passes waiting less; beyond it, it is given up.
# 50 ms covers the run-queue waits of a loaded machine (README: tens of ms without real-time
# priority) while a stall of seconds re-runs at most 50 ms of passes in a burst (5 passes of
# 10 ms; at a high speedup ratio more, but such a loop already runs flat out).
CATCH_UP_S = 0.05


class EngineLoop:
    """Runs passes for one rank and applies its commands between them."""

    def __init__(
        self,
        engine: Engine,
        *,
        kv: KvSink,
        fpm: FpmSink,
        delivery: Delivery,
        model_clock: ModelClock,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep | None = None,
        wall_clock: Callable[[], float] = time.time,
        deadlines: Deadlines | None = None,
        collector: Collector | None = None,
    ) -> None:
        """`model_clock` is the process's one map of modelled time to the wall (the rank
        layout's in the daemon; a worker process builds its own from the same config), so
        every rank and consumer of the process maps at one ratio.

        `clock` (seconds) and `sleep` (waits that many seconds of `clock`) are the loop's
        time; the defaults are the monotonic clock and the event loop's timers, and a test
        passes a virtual clock and its sleep to run paced passes without waiting. Without a
        `sleep`, passes are paced by an `engined.server.ranks.pacer` opened on the first
        paced wait (a timerfd for the default clock on Linux, else the event loop's timers)
        and closed when `run` ends. A paced loop records in `deadlines` (shared by the ranks of one
        event loop, on the same clock) when it next needs the loop, cuts its inbox turn
        short for a rank already due, and offers `collector` every wait
        (engined.server.ranks.deadlines, engined.server.ranks.collector).
        """
        self.engine = engine
        self.rank = engine.dp_rank
        self._kv = kv
        self._fpm = fpm
        self._delivery = delivery
        self.model_clock = model_clock
        self._paced = model_clock.paced
        self._clock = clock
        self._timers = LoopTimers(clock, sleep, paced=self._paced)
        self._wall_clock = wall_clock
        self.pass_observers: list[PassObserver] = []
        self.command_observers: list[CommandObserver] = []
        self._inbox = RankInbox(
            engine,
            kv=kv,
            delivery=delivery,
            observers=self.command_observers,
            core_ms=self._core_ms,
            clock=clock,
            wall_clock=wall_clock,
            deadlines=deadlines if self._paced else None,
        )
        self._wake = Wake()
        self._start = clock()
        self._virtual_ms = 0.0
        self._stopped = False
        self.passes_total = 0
        self.tokens_total = 0
        # How late each pass actually started against its planned start (paced only).
        self.lateness = LatenessWindow(clock)
        # Paced, back to back: the previous pass's modeled end (`now_ms`), the next one's start.
        self._next_start: float | None = None
        self._deadlines = deadlines if self._paced else None
        self._collector = collector if self._paced else None
        # In `_wait_for_work`: a command wakes the loop (paced waits are not interrupted).
        self._awaiting_command = False
        # `until_idle` callers, and whether the loop sleeps with nothing left to do.
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._idle = False

    @property
    def kv_overflows(self) -> int:
        """KV event sends some slow subscriber missed (its queue's byte budget was full)."""
        return self._kv.overflows

    # --- commands -----------------------------------------------------------------------

    def send(self, command: Command) -> None:
        """Apply `command` at the next pass boundary; nobody awaits it (a refusal is logged)."""
        self._inbox.append((command, self.now_ms(), None))
        self._needed_now()
        self._wake.set()

    async def call(self, command: Command) -> CommandReport:
        """Apply a command at the next boundary; raises its CoreError if it failed."""
        future: asyncio.Future[CommandReport] = asyncio.get_running_loop().create_future()
        self._inbox.append((command, self.now_ms(), future))
        self._needed_now()
        self._wake.set()
        return await future

    async def until_idle(self) -> None:
        """Return once nothing is queued, running or parked on this rank and no command
        waits: everything received before the call has been applied, and every output and
        lifecycle event it caused has been delivered. Held sources, reserved destinations
        and tier transfers do not count as work. A rank that stops also releases waiters.
        """
        if self._idle and not self._inbox:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._idle_waiters.append(future)
        self._wake.set()  # a sleeping loop looks again, and finds itself idle
        await future

    # --- gauges -------------------------------------------------------------------------

    @property
    def capacity_tokens(self) -> int:
        return self.engine.usable_blocks * self.engine.block_size

    def backlog(self) -> int:
        return self.engine.num_waiting() + len(self._inbox)

    def gauges(self) -> RankGauges:
        return RankGauges(
            self.engine.metrics(),
            self.passes_total,
            self.tokens_total,
            self._kv.overflows,
            self.lateness.summary(),
        )

    async def fresh_gauges(self) -> RankGauges:
        """`gauges`: an in-process rank's figures are always current."""
        return self.gauges()

    def _needed_now(self) -> None:
        """A command came: a rank waiting for work needs the loop at once (one pacing a pass
        applies it at that pass's deadline, already recorded)."""
        if self._deadlines is not None and self._awaiting_command:
            self._deadlines.set(self.rank, self._clock())

    def _release_idle_waiters(self) -> None:
        waiters, self._idle_waiters = self._idle_waiters, []
        for future in waiters:
            if not future.done():
                future.set_result(None)

    def stop(self) -> None:
        """End the loop once its core is empty and its inbox drained."""
        self._stopped = True
        self._wake.set()

    # --- the loop -----------------------------------------------------------------------

    def now_ms(self) -> float:
        """The modelled time now (paced: the loop's clock since the start, mapped)."""
        if self._paced:
            return self.model_clock.to_modelled_ms(self._clock() - self._start)
        return self._virtual_ms

    def _core_ms(self) -> float:
        """The time the core is given: `now_ms`, except while passes run back to back and the
        previous one's modeled end has passed, when it is that end (the schedule), trailing
        `now_ms` by at most CATCH_UP_S. Never more than `now_ms`, and never less than what
        the core was last given (the schedule only moves forward while it holds)."""
        now = self.now_ms()
        planned = self._next_start
        if planned is None or now <= planned:
            return now
        return max(planned, now - self.model_clock.to_modelled_ms(CATCH_UP_S))

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self._release_idle_waiters()
            self._timers.close()

    async def _run(self) -> None:
        engine = self.engine
        progressed = True
        while True:
            if not self._inbox and (engine.is_empty() or not progressed):
                idle = engine.is_empty()
                if idle and self._idle_waiters:
                    self._release_idle_waiters()
                if self._stopped and idle:
                    return
                self._idle = idle
                await self._wait_for_work()
                self._idle = False
                progressed = True
            self._inbox.drain(bounded=self._paced and not engine.is_empty())
            if engine.is_empty():
                self._advance_tiers()
                continue
            start_ms = self._core_ms()
            result = self._execute(start_ms)
            progressed = result.progressed
            if not progressed:
                continue
            if self.pass_observers:
                report = PassReport.of(result)
                for observer in self.pass_observers:
                    observer(self.rank, start_ms, report)
            await self._pace(result.end_ms)
            self._publish(result)

    def _execute(self, start_ms: float) -> PassResult:
        if self._next_start is not None:
            late_ms = max(self.now_ms() - self._next_start, 0.0)
            self.lateness.add(self.model_clock.to_wall_s(late_ms) * 1000.0)
        result = self.engine.execute_pass(start_ms)
        self.passes_total += 1
        if result.kv_events:
            self._kv.publish(result.kv_events, self._wall_clock())
        return result

    async def _pace(self, end_ms: float) -> None:
        """Wait for the pass's modeled end; always yields at least once (see the module doc)."""
        if not self._paced:
            self._virtual_ms = max(self._virtual_ms, end_ms)
            await asyncio.sleep(0)
            return
        self._next_start = end_ms
        deadline = self._start + self.model_clock.to_wall_s(end_ms)
        if self._deadlines is not None:
            self._deadlines.set(self.rank, deadline)
        if self._collector is not None:
            self._collector.offer()
        if deadline <= self._clock():
            # Late: no waiting, but the rest of the daemon gets its turn before the next pass.
            await asyncio.sleep(0)
            return
        wake = self._wake
        while True:
            self._inbox.apply_early_submits(deadline)
            remaining = deadline - self._clock()
            if remaining <= EARLY_MARGIN_S or self._inbox:
                break  # too close to wait for more, or the next command waits for the boundary
            wake.clear()
            if not await self._timers.wait_event(wake, remaining, precise=True):
                return
        if remaining <= 0:
            await asyncio.sleep(0)
        else:
            await self._timers.sleep_until(deadline)

    def _publish(self, result: PassResult) -> None:
        if result.outputs or result.decodes.request_ids:
            self.tokens_total += result.accept_length_output_tokens
            self._delivery.deliver_outputs(self.rank, result.outputs, result.decodes)
        fpm = result.fpm
        if self._paced:
            wall_s = self.model_clock.reported_s(fpm.wall_time_secs)
            if wall_s != fpm.wall_time_secs:  # not at ratio 1
                fpm = msgspec.structs.replace(fpm, wall_time_secs=wall_s)
        self._fpm.publish(fpm)
        if result.lifecycle_events:
            self._delivery.deliver_lifecycle(self.rank, result.lifecycle_events)

    async def _wait_for_work(self) -> None:
        """Sleep until a command arrives or a tier transfer is due, with FPM heartbeats."""
        self._next_start = None
        if self._deadlines is not None:
            self._deadlines.set(self.rank, None)
        self._awaiting_command = True
        collector = self._collector
        wake = self._wake
        while not wake.is_set():
            if collector is not None:
                # Also every heartbeat: idle ranks still see control traffic allocate.
                collector.offer()
            timeout = HEARTBEAT_INTERVAL_S
            due_in = self._offload_due_in()
            if due_in is not None:
                if due_in <= 0:
                    await asyncio.sleep(0)  # due now: still let commands and other ranks in
                    break
                timeout = min(timeout, due_in)
            precise = due_in is not None and due_in <= timeout
            if not await self._timers.wait_event(wake, timeout, precise=precise):
                self._fpm.maybe_heartbeat(self._clock())
        self._awaiting_command = False
        wake.clear()

    def _offload_due_in(self) -> float | None:
        """Seconds until the core's next tier-transfer deadline (None: no transfer).

        Measured with `_core_ms`, as `_advance_tiers` is, so "due" means the same to both. At
        speedup 0 nothing waits for time: the virtual clock moves to the deadline.
        """
        deadline_ms = self.engine.next_deadline()
        if deadline_ms is None:
            return None
        if not self._paced:
            self._virtual_ms = max(self._virtual_ms, deadline_ms)
            return 0.0
        return self.model_clock.to_wall_s(deadline_ms - self._core_ms())

    def _advance_tiers(self) -> None:
        """Land the tier transfers due by now on an empty engine and publish their events."""
        engine = self.engine
        deadline_ms = engine.next_deadline()
        now_ms = self._core_ms()
        if deadline_ms is None or now_ms < deadline_ms:
            return
        advanced = engine.advance_tiers(now_ms)
        if advanced.kv_events:
            self._kv.publish(advanced.kv_events, self._wall_clock())
        if advanced.lifecycle_events:
            self._delivery.deliver_lifecycle(self.rank, advanced.lifecycle_events)
