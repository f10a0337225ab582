"""vLLM's pause and sleep across the daemon's ranks: `pause`, `resume`, `sleep`, `wake_up`,
`release_kv_cache_memory`.

vLLM's DP client sends these utility calls to every engine (`DPLBAsyncMPClient`'s
`call_utility_async` goes to all of them, vllm/v1/engine/core_client.py), and `pause_generation`
and `sleep` return only once every engine's pause has completed. So each message here is
applied to every rank in turn, the requests an `abort` ended go to their owners as a cancel's
do (`Ownership.end_ended`: one `cancelled` terminal each), and the reply (a `stats`, which
carries the pause and sleep gauges) waits until no rank's pause is pending.

A wait is bounded by count, not by time (vLLM's call has no deadline either): at most
`PAUSE_CLIENT_LIMIT` waiting replies per client and `PAUSE_LIMIT` in all, each holding one
future, so a client that sends many, or disconnects while waiting, holds no more than that;
the pause itself never blocks anything else. Shutdown answers the waits still held
(`close`), since a pause waiting on a request nobody ends would otherwise hold it.

Whether a rank refuses new requests (vLLM's `reject_new_requests`, set by `abort` and `wait`
pauses) is the core's gauge `rejecting`; it changes only with these commands, so it is read
once after each and kept here for every submit to check cheaply (`rejecting`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Final

from engined.core.command_report import CommandReport
from engined.core.errors import CoreError
from engined.core.pass_report import PassReport
from engined.core.types import Command
from engined.server.control.ownership import Ownership
from engined.server.control.reports import Reports
from engined.server.control.wait_slots import WaitSlots
from engined.server.ranks.rank_handle import RankHandle
from engined.wire import control as wire
from engined.wire.convert import to_core_command

# (identity, message id, error code, message): an `error` reply.
Error = Callable[[bytes, int | str | None, str, str], None]
Reply = Callable[[bytes, wire.DaemonMessage], None]
PauseMessage = wire.Pause | wire.Resume | wire.Sleep | wire.WakeUp | wire.ReleaseKvCacheMemory
PAUSE_MESSAGES: Final = (
    wire.Pause,
    wire.Resume,
    wire.Sleep,
    wire.WakeUp,
    wire.ReleaseKvCacheMemory,
)

# Times a sleep-mode operation by its name, around the block (`SleepModeOperations.record`).
RecordOperation = Callable[[str], AbstractContextManager[None]]
# The operations vLLM's dev routes time, by the message that carries each.
_OPERATIONS: Final[dict[type, str]] = {
    wire.Sleep: "sleep",
    wire.ReleaseKvCacheMemory: "release_kv_cache_memory",
    wire.WakeUp: "wake",
}

# `pause` and `sleep` replies waiting at once, from one client and from all together.
PAUSE_CLIENT_LIMIT = 16
PAUSE_LIMIT = 256

# vLLM's `RequestError` message for a request added while generation is paused
# (`EngineCore._reject_add_while_paused`, vllm/v1/engine/core.py).
PAUSED_MESSAGE = "Generation is paused. Please retry after it resumes."


class ShuttingDown(Exception):
    """The daemon shuts down while a pause reply waits."""


class Pauses:
    """The pause and sleep handlers of one control server, over its ranks."""

    def __init__(
        self,
        ranks: Sequence[RankHandle],
        *,
        ownership: Ownership,
        reports: Reports,
        reply: Reply,
        error: Error,
        record: RecordOperation | None = None,
    ) -> None:
        """`record` times the sleep-mode operations (`sleep`, `wake_up`,
        `release_kv_cache_memory`), as vLLM's API server does
        (engined.server.ops.sleep_mode_operations); None: a daemon without metrics."""
        self._ranks = ranks
        self._ownership = ownership
        self._reports = reports
        self._reply = reply
        self._error = error
        self._record = record
        # Per rank: whether it refuses new requests, as of the last pause command applied.
        self.rejecting = [rank.gauges().metrics.rejecting for rank in ranks]
        # Per rank: futures set once its pause is no longer pending.
        self._waiters: list[list[asyncio.Future[None]]] = [[] for _ in ranks]
        self._slots = WaitSlots(
            per_client=PAUSE_CLIENT_LIMIT, total=PAUSE_LIMIT, what="pause or sleep replies"
        )
        self._closed = False
        for loop in ranks:
            loop.pass_observers.append(self._after_pass)
            loop.command_observers.append(self._after_command)

    def admit(self, identity: bytes, msg: PauseMessage) -> tuple[wire.ErrorCode, str] | None:
        """Count a waiting reply for `identity` and return None, or why it cannot wait
        (code, message)."""
        if not isinstance(msg, wire.Pause | wire.Sleep):
            return None
        return self._slots.admit(identity)

    async def apply(self, identity: bytes, msg: PauseMessage) -> None:
        operation = _OPERATIONS.get(type(msg))
        if operation is None or self._record is None:
            await self._apply(identity, msg)
            return
        with self._record(operation):
            await self._apply(identity, msg)

    async def _apply(self, identity: bytes, msg: PauseMessage) -> None:
        """Apply `msg` on every rank, then reply `stats` (once the pauses completed, for
        `pause` and `sleep`, admitted by `admit`). The cores refuse alike (mocker semantics,
        async scheduling), so a refusal comes from the first rank, before any has changed;
        a `release_kv_cache_memory` may find ranks in different states (one still pausing),
        and, as vLLM's call to every engine, leaves the ranks before the refusing one
        released."""
        waits = isinstance(msg, wire.Pause | wire.Sleep)
        try:
            command = to_core_command(msg)
            for rank, loop in enumerate(self._ranks):
                try:
                    report = await loop.call(command)
                except CoreError as exc:
                    self._error(identity, msg.id, exc.code, str(exc))
                    return
                self.rejecting[rank] = loop.gauges().metrics.rejecting
                self._ownership.end_ended(rank, report.ended)
            if waits:
                for rank in range(len(self._ranks)):
                    await self._completed(rank)
        except ShuttingDown:
            self._error(identity, msg.id, "shutting_down", "the daemon is shutting down")
            return
        finally:
            if waits:
                self._slots.release(identity)
        self._reply(identity, self._reports.stats(msg.id))

    def close(self) -> None:
        """Shutdown: answer every waiting reply `shutting_down`, and wait no more."""
        self._closed = True
        for waiters in self._waiters:
            for future in waiters:
                if not future.done():
                    future.set_exception(ShuttingDown())
            waiters.clear()

    @property
    def waiting_clients(self) -> int:
        """Identities with a pause reply waiting (tests: the per-client counts are freed)."""
        return self._slots.clients

    async def _completed(self, rank: int) -> None:
        if not self._ranks[rank].gauges().metrics.pause_pending:
            return
        if self._closed:
            raise ShuttingDown()
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters[rank].append(future)
        await future

    def _after_pass(self, rank: int, start_ms: float, report: PassReport) -> None:
        if self._waiters[rank] and not report.metrics.pause_pending:
            self._wake(rank)

    def _after_command(
        self, rank: int, called_ms: float, command: Command, report: CommandReport
    ) -> None:
        if self._waiters[rank] and not self._ranks[rank].gauges().metrics.pause_pending:
            self._wake(rank)

    def _wake(self, rank: int) -> None:
        waiters, self._waiters[rank] = self._waiters[rank], []
        for future in waiters:
            if not future.done():
                future.set_result(None)
