"""What the ranks report to clients: the `stats` reply, and `wait_idle`'s wait for it.

Apart from the control server because neither routes anything: they read the ranks'
gauges (`RankHandle.gauges`, or `fresh_gauges` where a worker process must be asked), and
bound how many waits may be held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from engined.server.control.wait_slots import WaitSlots
from engined.server.ranks.rank_gauges import RankGauges
from engined.server.ranks.rank_handle import RankHandle
from engined.wire import control as wire
from engined.wire.convert import rank_stats

# `wait_idle` messages waiting at once, from every client together, and from one client: a
# client waiting on each rank of a 64-rank daemon at once fits, and it takes 16 clients, not
# one, to fill the daemon's room and have a bystander's wait refused.
WAIT_IDLE_LIMIT = 1024
WAIT_IDLE_CLIENT_LIMIT = 64


class Reports:
    """`stats` and `wait_idle` over the daemon's ranks."""

    def __init__(
        self, loops: Sequence[RankHandle], weight_versions: Mapping[int, str] | None = None
    ) -> None:
        """`weight_versions[rank]`: the label of the rank's outputs (absent: "default")."""
        self._loops = loops
        self._versions: Mapping[int, str] = {} if weight_versions is None else weight_versions
        self._slots = WaitSlots(
            per_client=WAIT_IDLE_CLIENT_LIMIT, total=WAIT_IDLE_LIMIT, what="wait_idle messages"
        )

    def stats(self, msg_id: int | str | None = None) -> wire.StatsReply:
        """Every rank's figures as known here now."""
        return _stats_reply(msg_id, [loop.gauges() for loop in self._loops], self._versions)

    async def fresh_stats(self, msg_id: int | str | None) -> wire.StatsReply:
        """`stats` once every rank has sent its figures as of now (a worker's lateness would
        otherwise be as of its last heartbeat, up to a second old)."""
        gauges = await asyncio.gather(*(loop.fresh_gauges() for loop in self._loops))
        return _stats_reply(msg_id, gauges, self._versions)

    def admit_wait(self, msg: wire.WaitIdle, identity: bytes) -> tuple[wire.ErrorCode, str] | None:
        """Count `msg` as waiting for `identity` and return None, or return why it cannot
        wait (code, message)."""
        if msg.dp_rank is not None and msg.dp_rank >= len(self._loops):
            return "invalid_request", f"dp_rank: {msg.dp_rank} is out of range"
        return self._slots.admit(identity)

    async def until_idle(self, msg: wire.WaitIdle, identity: bytes) -> wire.StatsReply:
        """The stats once the named ranks are idle (after `admit_wait` admitted it)."""
        try:
            ranks = range(len(self._loops)) if msg.dp_rank is None else [msg.dp_rank]
            for rank in ranks:
                await self._loops[rank].until_idle()
        finally:
            self._slots.release(identity)
        return self.stats(msg.id)

    @property
    def waiting_clients(self) -> int:
        """Identities with a `wait_idle` waiting (tests: the per-client counts are freed)."""
        return self._slots.clients


class Refresh:
    """Every rank's figures as of now, before each `/metrics` scrape: a worker's replay and
    overflow counters otherwise travel only with its heartbeats. `loops` may still be
    filling: it is read at each call."""

    def __init__(self, loops: Sequence[RankHandle]) -> None:
        self._loops = loops

    async def __call__(self) -> None:
        await asyncio.gather(*(loop.fresh_gauges() for loop in self._loops))


def _stats_reply(
    msg_id: int | str | None, ranks: Sequence[RankGauges], versions: Mapping[int, str]
) -> wire.StatsReply:
    return wire.StatsReply(
        id=msg_id,
        ranks=[
            rank_stats(
                gauges.metrics,
                passes_total=gauges.passes_total,
                lateness_ms=gauges.lateness_ms,
                kv_events_overflows=gauges.kv_overflows,
                weight_version=versions.get(rank),
            )
            for rank, gauges in enumerate(ranks)
        ],
    )
