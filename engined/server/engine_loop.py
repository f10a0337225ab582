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

The loop reads only what the engine returns (`CommandEffects`, `PassResult`, `TierAdvance`)
and its public gauges, and tells its pass observers a `PassReport`; commands are
`engined.core` commands, applied through the inbox by `call` (the caller awaits the effects)
or `send` (fire and forget, e.g. a cancel for a vanished client). Either way the command
observers see the effects, so every request that ends is seen ending.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import structlog

from engined.core.engine import Engine
from engined.core.errors import CoreError
from engined.core.pass_report import PassReport
from engined.core.types import (
    Command,
    CommandEffects,
    Decodes,
    KvEvent,
    LifecycleEvent,
    PassResult,
    RequestOutput,
    Submit,
)
from engined.server.collector import Collector
from engined.server.deadlines import Deadlines
from engined.server.pacer import Pacer, open_pacer

log = structlog.get_logger(__name__)

HEARTBEAT_INTERVAL_S = 1.0
# Paced, with requests running: the most time (seconds of the loop's clock) a pass boundary
# spends applying queued commands before the due pass runs (`_drain_inbox`).
INBOX_TURN_S = 0.001
# Paced: a submission that arrives while a pass is paced is applied at once, unless the
# pass's deadline is nearer than this (seconds): a submission hashes its prompt, ~0.05 ms.
EARLY_MARGIN_S = 0.0003
# Paced: how far (seconds of the loop's clock) the schedule of back-to-back passes may trail
# it. Lateness up to this is caught up by later passes waiting less; beyond it, it is given up.
# 50 ms covers the run-queue waits of a loaded machine (README: tens of ms without real-time
# priority) while a stall of seconds re-runs at most 50 ms of passes in a burst (5 passes of
# 10 ms; at a high speedup ratio more, but such a loop already runs flat out).
CATCH_UP_S = 0.05
# Pass-start lateness percentiles are re-sorted at most this often (seconds of `clock`), so a
# client polling `stats` costs a sort of the window per interval, not per message; a window
# of at most LATENESS_CHEAP_SORT passes (~0.05 ms to sort) is re-sorted whenever it changed.
LATENESS_SUMMARY_TTL_S = 0.1
LATENESS_CHEAP_SORT = 1024

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

    def deliver_outputs(
        self, rank: int, outputs: list[RequestOutput], decodes: Decodes
    ) -> None: ...

    def deliver_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None: ...


# A command waiting for the next pass boundary: the command, the `now_ms` of its arrival,
# and the future of its caller (None: sent, nobody awaits its effects).
_Entry = tuple[Command, float, "asyncio.Future[CommandEffects] | None"]
# Told of every pass that changed something, right after it ran: (rank, pass start ms, report).
# Before pacing, so no await separates the core's new state from what observers saw, and their
# work fits in the pass's modeled time. Prometheus metrics (engined.server.metrics) are one.
# A `PassReport`, not the `PassResult`: observers see a rank in a worker process the same way.
PassObserver = Callable[[int, float, PassReport], None]
# Told of every command applied without error: (rank, ms when `call` was made, or when it was
# applied if that is earlier (`_core_ms`, catching up), command, effects).
CommandObserver = Callable[[int, float, Command, CommandEffects], None]


class EngineLoop:
    """Runs passes for one rank and applies its commands between them."""

    def __init__(
        self,
        engine: Engine,
        *,
        kv: KvSink,
        fpm: FpmSink,
        delivery: Delivery,
        speedup_ratio: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Sleep | None = None,
        wall_clock: Callable[[], float] = time.time,
        deadlines: Deadlines | None = None,
        collector: Collector | None = None,
    ) -> None:
        """`clock` (seconds) and `sleep` (waits that many seconds of `clock`) are the loop's
        time; the defaults are the monotonic clock and the event loop's timers, and a test
        passes a virtual clock and its sleep to run paced passes without waiting. Without a
        `sleep`, passes are paced by an `engined.server.pacer` opened on the first paced wait
        (a timerfd for the default clock on Linux, else the event loop's timers) and closed
        when `run` ends. A paced loop records in `deadlines` (shared by the ranks of one
        event loop, on the same clock) when it next needs the loop, cuts its inbox turn
        short for a rank already due, and offers `collector` every wait
        (engined.server.deadlines, engined.server.collector).
        """
        self.engine = engine
        self.rank = engine.dp_rank
        self._kv = kv
        self._fpm = fpm
        self._delivery = delivery
        self._paced = speedup_ratio > 0
        self._clock = clock
        self._sleep = sleep
        self._wall_clock = wall_clock
        self._inbox: deque[_Entry] = deque()
        self._wake = asyncio.Event()
        self._start = clock()
        self._virtual_ms = 0.0
        self._stopped = False
        self.passes_total = 0
        self.tokens_total = 0
        # How late each pass actually started against its planned start, in ms (paced only).
        self.lateness_ms: deque[float] = deque(maxlen=100_000)
        self._lateness_summary: tuple[float, float, float] = (0.0, 0.0, 0.0)
        self._lateness_at: tuple[int, float] | None = None  # (passes_total, clock) of it
        # Paced, back to back: the previous pass's modeled end (`now_ms`), the next one's start.
        self._next_start: float | None = None
        self._pacer: Pacer | None = None
        self._deadlines = deadlines if self._paced else None
        self._collector = collector if self._paced else None
        # In `_wait_for_work`: a command wakes the loop (paced waits are not interrupted).
        self._awaiting_command = False
        # `until_idle` callers, and whether the loop sleeps with nothing left to do.
        self._idle_waiters: list[asyncio.Future[None]] = []
        self._idle = False
        self.pass_observers: list[PassObserver] = []
        self.command_observers: list[CommandObserver] = []

    @property
    def kv_overflows(self) -> int:
        """KV event sends some slow subscriber missed (its queue's byte budget was full)."""
        return self._kv.overflows

    def lateness_summary(self) -> tuple[float, float, float]:
        """p50, p99 and max of pass-start lateness in ms (zeros before any paced pass).

        Exact when no pass ran since the last call or the window is short; otherwise at most
        LATENESS_SUMMARY_TTL_S old, since sorting the 100,000-pass window costs ~10 ms and
        `stats` is a cheap message.
        """
        now = self._clock()
        cached = self._lateness_at
        if cached is not None and (
            cached[0] == self.passes_total
            or (
                now - cached[1] < LATENESS_SUMMARY_TTL_S
                and len(self.lateness_ms) > LATENESS_CHEAP_SORT
            )
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

    def send(self, command: Command) -> None:
        """Apply `command` at the next pass boundary; nobody awaits it (a refusal is logged)."""
        self._inbox.append((command, self.now_ms(), None))
        self._needed_now()
        self._wake.set()

    async def call(self, command: Command) -> CommandEffects:
        """Apply a command at the next boundary; raises its CoreError if it failed."""
        future: asyncio.Future[CommandEffects] = asyncio.get_running_loop().create_future()
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

    # Every figure (`lateness_summary`, `kv_overflows`...) is read from the loop itself.
    gauges_live = True

    async def refresh(self) -> None:
        """Nothing to fetch: an in-process rank's figures are always current."""

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
        if self._paced:
            return (self._clock() - self._start) * 1000.0
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
        return max(planned, now - CATCH_UP_S * 1000.0)

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            self._release_idle_waiters()
            pacer, self._pacer = self._pacer, None
            if pacer is not None:
                pacer.close()

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
            self._drain_inbox()
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
            self.lateness_ms.append(max(self.now_ms() - self._next_start, 0.0))
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
        deadline = self._start + end_ms / 1000.0
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
            self._apply_early_submits(deadline)
            remaining = deadline - self._clock()
            if remaining <= EARLY_MARGIN_S or self._inbox:
                break  # too close to wait for more, or the next command waits for the boundary
            wake.clear()
            if not await self._wait_event(wake, remaining, precise=True):
                return
        if remaining <= 0:
            await asyncio.sleep(0)
        elif self._sleep is not None:
            await self._sleep(remaining)
        else:
            await self._precise_sleep(deadline)

    def _apply_early_submits(self, deadline: float) -> None:
        """Apply the submissions at the head of the inbox in the wait, as vLLM's input thread
        takes requests while a step runs: at the deadline they would hold the due pass (16
        prompts of 512 tokens hash for ~1 ms). Anything else (a cancel, a handoff) keeps its
        place at the boundary, after this pass's outputs; none starts close to this deadline
        or once another rank is due (`Deadlines.overdue`), as in the inbox turn."""
        self._apply_queued(deadline - EARLY_MARGIN_S, submits_only=True, first_free=False)

    async def _precise_sleep(self, deadline: float) -> None:
        """Sleep until `clock()` reaches `deadline`, without spinning (engined.server.pacer).

        The pacer is opened here, on the event loop that runs the passes, and reused (one
        timerfd per rank, re-armed for every pass); `run` closes it when the loop ends.

        NOTE: the selector returns at the deadline, but the pass still starts behind what the
        event loop already holds (other ranks' due passes, at most one control turn, see
        engined.server.control, and the handlers it spawned), then this rank's inbox turn. A
        kernel wake-up costs ~0.05-0.1 ms that the old sleep(0) spin did not.
        """
        await self._opened_pacer().sleep_until(deadline)

    def _opened_pacer(self) -> Pacer:
        """The loop's pacer, opened on first use (on the event loop that runs the passes)."""
        pacer = self._pacer
        if pacer is None:
            pacer = self._pacer = open_pacer(self._clock)
        return pacer

    def _publish(self, result: PassResult) -> None:
        if result.outputs or result.decodes.request_ids:
            self.tokens_total += result.accept_length_output_tokens
            self._delivery.deliver_outputs(self.rank, result.outputs, result.decodes)
        self._fpm.publish(result.fpm)
        if result.lifecycle_events:
            self._delivery.deliver_lifecycle(self.rank, result.lifecycle_events)

    def _drain_inbox(self) -> None:
        """Apply the queued commands in arrival order; their KV events go out as one batch,
        before the next pass's (a reset's AllBlocksCleared, the offloads a command starts).

        Paced with requests running, a boundary applies commands for at most INBOX_TURN_S of
        the loop's clock (one at least) and leaves the rest to the next: a burst would
        otherwise hold a due pass, and every running request's next token. The turn also
        ends once another rank of the loop is due (`Deadlines.overdue`): its pass goes first.
        Unpaced, everything is applied: nobody waits on a virtual clock, and the order of
        work stays exact.
        """
        bounded = self._paced and not self.engine.is_empty()
        turn_ends = self._clock() + INBOX_TURN_S if bounded else None
        self._apply_queued(turn_ends, submits_only=False, first_free=True)

    def _apply_queued(self, until: float | None, *, submits_only: bool, first_free: bool) -> None:
        """Apply commands from the head of the inbox, in order, and publish their KV events as
        one batch. With `until` (the loop's clock), each command starts only before it and
        while no other rank of the loop is due (`first_free`: the first one regardless);
        `submits_only` stops at the first command that is not a plain submission."""
        inbox = self._inbox
        clock = self._clock
        deadlines = self._deadlines
        kv_events: list[KvEvent] = []
        first = True
        while inbox:
            if submits_only and type(inbox[0][0]) is not Submit:
                break
            if until is not None and not (first and first_free):
                now = clock()
                if now >= until or (
                    deadlines is not None and deadlines.overdue(now, but=self.rank)
                ):
                    break
            first = False
            kv_events += self._apply(inbox.popleft())
        if kv_events:
            self._kv.publish(kv_events, self._wall_clock())

    def _apply(self, entry: _Entry) -> list[KvEvent]:
        """Apply one queued command and answer its caller; returns its KV events."""
        command, arrived_ms, future = entry
        applied_ms = self._core_ms()
        try:
            # An offload the command causes starts when the command is applied.
            effects = self.engine.apply(command, now_ms=applied_ms)
        except CoreError as exc:
            if future is None:
                log.warning("command refused", command=type(command).__name__, error=str(exc))
            elif not future.done():  # its caller may have given up waiting
                future.set_exception(exc)
            return []
        arrived_ms = min(arrived_ms, applied_ms)
        for observer in self.command_observers:
            observer(self.rank, arrived_ms, command, effects)
        if future is not None and not future.done():
            future.set_result(effects)
        if effects.lifecycle_events:
            self._delivery.deliver_lifecycle(self.rank, effects.lifecycle_events)
        return effects.kv_events

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
            if not await self._wait_event(wake, timeout, precise=precise):
                self._fpm.maybe_heartbeat(self._clock())
        self._awaiting_command = False
        wake.clear()

    async def _wait_event(self, event: asyncio.Event, timeout: float, *, precise: bool) -> bool:
        """Whether `event` was set within `timeout` seconds of the loop's clock. `precise`
        (a tier-transfer deadline, paced): on the pacer's timer, as a pass's end is, rather
        than on asyncio's, which wakes up to 1 ms late."""
        timed: Awaitable[None]
        if self._sleep is not None:
            timed = self._sleep(timeout)
        elif precise and self._paced:
            timed = self._opened_pacer().sleep_until(self._clock() + timeout)
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
        return (deadline_ms - self._core_ms()) / 1000.0

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
