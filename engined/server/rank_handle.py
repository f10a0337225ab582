"""What the control server, the metrics, the load watch and the daemon use of one rank.

A rank runs either in the daemon's own event loop (`engined.server.engine_loop.EngineLoop`)
or in a worker process, seen from the daemon through a `engined.server.rank_proxy.RankProxy`.
Both satisfy `RankHandle`, so the code that routes clients' commands and reads gauges is the
same for both layouts and type-checks against either: it never learns where the rank runs.
"""

from __future__ import annotations

from typing import Protocol

from engined.core.types import Command, CommandEffects, EngineMetrics
from engined.server.engine_loop import CommandObserver, PassObserver


class EngineView(Protocol):
    """The engine's read-only gauges the daemon reads between passes (`Engine` has them)."""

    @property
    def usable_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def metrics(self) -> EngineMetrics: ...

    def num_waiting(self) -> int: ...


class RankHandle(Protocol):
    """One data-parallel rank as the daemon drives it.

    `call` awaits a command's effects (raising its `CoreError`), `send` fires and forgets;
    observers are told of every pass that progressed and every command applied, in the order
    the rank did them; `stop` asks the rank to end once drained and `run` returns when it has.
    """

    @property
    def rank(self) -> int: ...

    @property
    def engine(self) -> EngineView: ...

    @property
    def queued(self) -> int: ...

    @property
    def passes_total(self) -> int: ...

    @property
    def tokens_total(self) -> int: ...

    @property
    def kv_overflows(self) -> int: ...

    @property
    def pass_observers(self) -> list[PassObserver]: ...

    @property
    def command_observers(self) -> list[CommandObserver]: ...

    def lateness_summary(self) -> tuple[float, float, float]: ...

    def now_ms(self) -> float: ...

    def send(self, command: Command) -> None: ...

    async def call(self, command: Command) -> CommandEffects: ...

    async def until_idle(self) -> None: ...

    # False where `lateness_summary` and the replay counters may lag (a worker process):
    # `stats` then awaits `refresh` first.
    @property
    def gauges_live(self) -> bool: ...

    async def refresh(self) -> None: ...

    def stop(self) -> None: ...

    async def run(self) -> None: ...
