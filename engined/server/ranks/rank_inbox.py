"""A rank's inbox: the commands waiting for a pass boundary, and how many one boundary applies.

Commands reach a rank through its inbox and are applied between passes (or, submissions
only, while a pass is paced), so a command never sees half a pass. Each caller is answered
as its command is applied, after the command observers saw its report (`CommandReport`, the
same value the caller gets); a command nobody awaits that the core refuses is logged.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable

import structlog

from engined.core.command_report import CommandReport
from engined.core.engine import Engine
from engined.core.errors import CoreError
from engined.core.types import Command, KvEvent, Submit
from engined.server.ranks.deadlines import Deadlines
from engined.server.ranks.rank_sinks import CommandObserver, Delivery, KvSink

log = structlog.get_logger(__name__)

# Paced, with requests running: the most time (seconds of the loop's clock) a pass boundary
# spends applying queued commands before the due pass runs (`drain`).
INBOX_TURN_S = 0.001
# Paced: a submission that arrives while a pass is paced is applied at once, unless the
# pass's deadline is nearer than this (seconds): a submission hashes its prompt, ~0.05 ms.
EARLY_MARGIN_S = 0.0003

# A command waiting for the next pass boundary: the command, the `now_ms` of its arrival,
# and the future of its caller (None: sent, nobody awaits its effects).
Entry = tuple[Command, float, "asyncio.Future[CommandReport] | None"]


class RankInbox:
    def __init__(
        self,
        engine: Engine,
        *,
        kv: KvSink,
        delivery: Delivery,
        observers: list[CommandObserver],
        core_ms: Callable[[], float],
        clock: Callable[[], float],
        wall_clock: Callable[[], float],
        deadlines: Deadlines | None,
    ) -> None:
        """`core_ms` is the time the core is given (`EngineLoop._core_ms`); `clock` the
        loop's, which bounds a turn; `deadlines` those of the other paced ranks of the loop."""
        self.engine = engine
        self.rank = engine.dp_rank
        self._entries: deque[Entry] = deque()
        self._kv = kv
        self._delivery = delivery
        self._observers = observers
        self._core_ms = core_ms
        self._clock = clock
        self._wall_clock = wall_clock
        self._deadlines = deadlines

    def __len__(self) -> int:
        return len(self._entries)

    def append(self, entry: Entry) -> None:
        self._entries.append(entry)

    def apply_early_submits(self, deadline: float) -> None:
        """Apply the submissions at the head of the inbox in the wait, as vLLM's input thread
        takes requests while a step runs: at the deadline they would hold the due pass (16
        prompts of 512 tokens hash for ~1 ms). Anything else (a cancel, a handoff) keeps its
        place at the boundary, after this pass's outputs; none starts close to this deadline
        or once another rank is due (`Deadlines.overdue`), as in the inbox turn."""
        self._apply_queued(deadline - EARLY_MARGIN_S, submits_only=True, first_free=False)

    def drain(self, *, bounded: bool) -> None:
        """Apply the queued commands in arrival order; their KV events go out as one batch,
        before the next pass's (a reset's AllBlocksCleared, the offloads a command starts).

        `bounded` (paced, with requests running): a boundary applies commands for at most
        INBOX_TURN_S of the loop's clock (one at least) and leaves the rest to the next: a
        burst would otherwise hold a due pass, and every running request's next token. The
        turn also ends once another rank of the loop is due (`Deadlines.overdue`): its pass
        goes first.
        Otherwise everything is applied: nobody waits on a virtual clock, and the order of
        work stays exact.
        """
        turn_ends = self._clock() + INBOX_TURN_S if bounded else None
        self._apply_queued(turn_ends, submits_only=False, first_free=True)

    def _apply_queued(self, until: float | None, *, submits_only: bool, first_free: bool) -> None:
        """Apply commands from the head of the inbox, in order, and publish their KV events as
        one batch. With `until` (the loop's clock), each command starts only before it and
        while no other rank of the loop is due (`first_free`: the first one regardless);
        `submits_only` stops at the first command that is not a plain submission."""
        inbox = self._entries
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

    def _apply(self, entry: Entry) -> list[KvEvent]:
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
        report = CommandReport.of(effects)
        for observer in self._observers:
            observer(self.rank, arrived_ms, command, report)
        if future is not None and not future.done():
            future.set_result(report)
        if effects.lifecycle_events:
            self._delivery.deliver_lifecycle(self.rank, effects.lifecycle_events)
        return effects.kv_events
