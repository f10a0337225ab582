"""What a command tells the daemon's observers and callers, wherever its rank runs.

`CommandEffects` also holds what only the rank's own process uses: the KV events its
publisher sends, the lifecycle events its delivery routes, and `progressed`, which only its
loop reads. A rank in a worker process keeps those there, so the command observers (the
Prometheus tallies, the load watch) and the callers awaiting `RankHandle.call` (ownership,
handoff commands) are given this narrower value instead, every field of which means the same
in both layouts (in process, it is taken from the `CommandEffects`; from a worker, it arrives
as it was taken there), as `PassReport` is for a pass.
"""

from __future__ import annotations

import msgspec

from engined.core.types import CommandEffects, CommandResult, EndedRequest


class CommandReport(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One command applied; each field is the `CommandEffects` field of its name."""

    result: CommandResult
    ended: list[EndedRequest] = []

    @classmethod
    def of(cls, effects: CommandEffects) -> CommandReport:
        return cls(result=effects.result, ended=effects.ended)
