"""Push each rank's KV load to the clients that asked for it (`watch_load`).

A KV-aware router weighs workers by their used blocks, and reads them as the engine changes
them: vLLM publishes its scheduler stats every step, and Dynamo's `WorkerMetricsPublisher`
relays them. Polling `stats` would be late by half the poll period and cost a round trip per
rank even when nothing moved; the engine loops already tell their observers about every pass
and command, with the gauges after it, so the watch sends a `load` message only when a rank's
figures changed, at most one per pass or command, to every watcher.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engined.core.command_report import CommandReport
from engined.core.pass_report import PassReport
from engined.core.types import Command, EngineMetrics
from engined.server.ranks.rank_handle import RankHandle
from engined.wire import control as wire
from engined.wire.convert import load_message

Send = Callable[[bytes, wire.DaemonMessage], None]


class LoadWatch:
    """The `watch_load` subscribers of one daemon and the last load each rank announced."""

    def __init__(self, loops: Sequence[RankHandle], send: Send) -> None:
        self._loops = loops
        self._send = send
        self._watchers: set[bytes] = set()
        self._last: list[wire.Load | None] = [None] * len(loops)
        for loop in loops:
            loop.pass_observers.append(self._after_pass)
            loop.command_observers.append(self._after_command)

    @property
    def watchers(self) -> int:
        return len(self._watchers)

    def watch(self, identity: bytes) -> None:
        """Subscribe `identity` and send it every rank's current load."""
        self._watchers.add(identity)
        for rank, loop in enumerate(self._loops):
            message = load_message(loop.gauges().metrics)
            self._last[rank] = message
            self._send(identity, message)

    def watching(self, identity: bytes) -> bool:
        return identity in self._watchers

    def forget(self, identity: bytes) -> bool:
        """The client is gone or dropped: stop sending to it; whether it was watching."""
        if identity in self._watchers:
            self._watchers.discard(identity)
            return True
        return False

    def _after_pass(self, rank: int, start_ms: float, result: PassReport) -> None:
        if self._watchers:
            self._announce(rank, result.metrics)

    def _after_command(
        self, rank: int, called_ms: float, command: Command, report: CommandReport
    ) -> None:
        if self._watchers:
            self._announce(rank, self._loops[rank].gauges().metrics)

    def _announce(self, rank: int, metrics: EngineMetrics) -> None:
        message = load_message(metrics)
        if message == self._last[rank]:
            return
        self._last[rank] = message
        # NOTE: a copy: a send that finds the client gone calls forget() during the loop.
        for identity in list(self._watchers):
            self._send(identity, message)
