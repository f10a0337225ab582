"""What the ranks report to clients: the `stats` reply, and `wait_idle`'s wait for it.

Apart from the control server because neither routes anything: they read the ranks'
figures (`RankHandle`), wait for ranks that keep theirs elsewhere (worker processes, whose
lateness travels with heartbeats unless asked), and bound how many waits may be held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from engined.server.rank_handle import RankHandle
from engined.wire import control as wire
from engined.wire.convert import rank_stats

# `wait_idle` messages waiting at once, from every client together, and from one client: a
# client waiting on each rank of a 64-rank daemon at once fits, and it takes 16 clients, not
# one, to fill the daemon's room and have a bystander's wait refused.
WAIT_IDLE_LIMIT = 1024
WAIT_IDLE_CLIENT_LIMIT = 64


class Reports:
    """`stats` and `wait_idle` over the daemon's ranks."""

    def __init__(self, loops: Sequence[RankHandle]) -> None:
        self._loops = loops
        self._waits = 0
        # Waits per client identity; an identity leaves with its last wait.
        self._waits_of: dict[bytes, int] = {}
        # Whether every figure `stats` reads is current without asking (in-process ranks).
        self.live = all(loop.gauges_live for loop in loops)

    def stats(self, msg_id: int | str | None = None) -> wire.StatsReply:
        return wire.StatsReply(
            id=msg_id,
            ranks=[
                rank_stats(
                    loop.engine.metrics(),
                    passes_total=loop.passes_total,
                    lateness_ms=loop.lateness_summary(),
                    kv_events_overflows=loop.kv_overflows,
                )
                for loop in self._loops
            ],
        )

    async def fresh_stats(self, msg_id: int | str | None) -> wire.StatsReply:
        """`stats` once every rank has sent its figures as of now (a worker's lateness would
        otherwise be as of its last heartbeat, up to a second old)."""
        await asyncio.gather(*(loop.refresh() for loop in self._loops))
        return self.stats(msg_id)

    def admit_wait(self, msg: wire.WaitIdle, identity: bytes) -> tuple[wire.ErrorCode, str] | None:
        """Count `msg` as waiting for `identity` and return None, or return why it cannot
        wait (code, message)."""
        if msg.dp_rank is not None and msg.dp_rank >= len(self._loops):
            return "invalid_request", f"dp_rank: {msg.dp_rank} is out of range"
        mine = self._waits_of.get(identity, 0)
        if mine >= WAIT_IDLE_CLIENT_LIMIT:
            return "overloaded", (
                f"this client has {WAIT_IDLE_CLIENT_LIMIT} wait_idle messages waiting already"
            )
        if self._waits >= WAIT_IDLE_LIMIT:
            return "overloaded", f"{WAIT_IDLE_LIMIT} wait_idle messages are already waiting"
        self._waits += 1
        self._waits_of[identity] = mine + 1
        return None

    async def until_idle(self, msg: wire.WaitIdle, identity: bytes) -> wire.StatsReply:
        """The stats once the named ranks are idle (after `admit_wait` admitted it)."""
        try:
            ranks = range(len(self._loops)) if msg.dp_rank is None else [msg.dp_rank]
            for rank in ranks:
                await self._loops[rank].until_idle()
        finally:
            self._waits -= 1
            left = self._waits_of[identity] - 1
            if left:
                self._waits_of[identity] = left
            else:
                del self._waits_of[identity]
        return self.stats(msg.id)

    @property
    def waiting_clients(self) -> int:
        """Identities with a `wait_idle` waiting (tests: the per-client counts are freed)."""
        return len(self._waits_of)


class Refresh:
    """Fetch the figures of every rank that keeps them elsewhere, once for all who ask meanwhile.

    Before each `/metrics` scrape: a worker's replay and overflow counters otherwise travel
    only with its heartbeats. Shared, so that a flood of scrapes costs each worker one request
    per round trip, not one per scrape. `loops` may still be filling: it is read at each call.
    """

    def __init__(self, loops: Sequence[RankHandle]) -> None:
        self._loops = loops
        self._pending: asyncio.Future[list[None]] | None = None

    async def __call__(self) -> None:
        pending = self._pending
        if pending is None or pending.done():
            remote = [loop.refresh() for loop in self._loops if not loop.gauges_live]
            if not remote:
                return
            pending = asyncio.ensure_future(asyncio.gather(*remote))
            self._pending = pending
        # A caller that gives up (the scrape's bound) leaves the refresh to the others.
        await asyncio.shield(pending)
