"""What the control server, the metrics, the load watch and the daemon use of one rank.

A rank runs either in the daemon's own event loop (`engined.server.ranks.engine_loop.EngineLoop`)
or in a worker process, seen from the daemon through a `engined.server.ranks.rank_proxy.RankProxy`.
Both satisfy `RankHandle`, so the code that routes clients' commands and reads gauges is the
same for both layouts and type-checks against either: it never learns where the rank runs.

Narrow on purpose: commands go in (`send`, `call`), and out come the observers' reports of
every pass and command and one gauges snapshot (`gauges`, or `fresh_gauges` where a worker
process must be asked). Nothing reaches the engine itself.
"""

from __future__ import annotations

from typing import Protocol

from engined.core.command_report import CommandReport
from engined.core.types import Command
from engined.server.ranks.rank_gauges import RankGauges
from engined.server.ranks.rank_sinks import CommandObserver, PassObserver


class RankHandle(Protocol):
    """One data-parallel rank as the daemon drives it.

    `call` awaits a command's report (raising its `CoreError`), `send` fires and forgets;
    observers are told of every pass that progressed and every command applied, in the order
    the rank did them; `stop` asks the rank to end once drained and `run` returns when it has.
    """

    @property
    def rank(self) -> int: ...

    @property
    def capacity_tokens(self) -> int:
        """The most prompt tokens the rank's KV pool can ever hold (a bigger prompt is
        refused before it is sent)."""
        ...

    @property
    def pass_observers(self) -> list[PassObserver]: ...

    @property
    def command_observers(self) -> list[CommandObserver]: ...

    def backlog(self) -> int:
        """Requests waiting in the core plus commands not yet applied: what
        `max_queued_requests` bounds, read for every submission, so cheap."""
        ...

    def gauges(self) -> RankGauges:
        """The rank's figures as known here now (a worker's: as of its latest report)."""
        ...

    async def fresh_gauges(self) -> RankGauges:
        """The rank's figures as of now: a worker is asked (once for all who ask meanwhile)."""
        ...

    def now_ms(self) -> float: ...

    def send(self, command: Command) -> None: ...

    async def call(self, command: Command) -> CommandReport: ...

    async def until_idle(self) -> None: ...

    def stop(self) -> None: ...

    async def run(self) -> None: ...
