"""What a rank's loop talks to besides its core: its publishers, where its results go, and
who is told of each pass and command.

Apart from `engined.server.ranks.engine_loop` so that the layouts, the rank workers, the rank
handle and the tests name these without importing the loop itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from engined.core.command_report import CommandReport
from engined.core.pass_report import PassReport
from engined.core.types import Command, Decodes, LifecycleEvent, RequestOutput

Sleep = Callable[[float], Awaitable[None]]


class KvSink(Protocol):
    def publish(self, events: list[Any], ts: float) -> None: ...

    @property
    def overflows(self) -> int: ...


class FpmSink(Protocol):
    def publish(self, snapshot: Any) -> None: ...

    def maybe_heartbeat(self, now: float) -> None: ...


class WorkerIdSink(Protocol):
    """A rank's FPM publisher (or its proxy): the Dynamo worker id it stamps, set by clients."""

    worker_id: str


class Delivery(Protocol):
    """Where a rank's results go: the control server routes them to clients."""

    def deliver_outputs(
        self, rank: int, outputs: list[RequestOutput], decodes: Decodes
    ) -> None: ...

    def deliver_lifecycle(self, rank: int, events: list[LifecycleEvent]) -> None: ...


# Told of every pass that changed something, right after it ran: (rank, pass start ms, report).
# Before pacing, so no await separates the core's new state from what observers saw, and their
# work fits in the pass's modeled time. Prometheus metrics (engined.server.ops.prometheus_metrics)
# are one. A `PassReport`, not the `PassResult`: observers see a rank in a worker process the
# same way.
PassObserver = Callable[[int, float, PassReport], None]
# Told of every command applied without error: (rank, ms when `call` was made, or when it was
# applied if that is earlier (`_core_ms`, catching up), command, report). A `CommandReport`,
# not the `CommandEffects`, for the same reason: a worker keeps its KV events.
CommandObserver = Callable[[int, float, Command, CommandReport], None]
