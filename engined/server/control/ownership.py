"""Who owns each active request and handoff route, and the one way a request ends early.

A request belongs to the client identity that submitted it; a handoff route to the identity
that registered that side (source or destination). Outputs go to the owner only, so a
request ended by anything but its own completion must tell its owner, or the owner's stream
never ends: a `cancel` from another client (a router or coordinator may cancel any
request), the owner's own `cancel`, `cancel_source` / `cancel_destination`, a handoff
session timeout, the owner being dropped, shutdown. All of them go through `Ownership.end`,
which forgets the owner and hands it one token-less `cancelled` terminal. Forgetting is the
pop of one dict entry, so whichever path comes first ends the request and the others find
nothing: exactly one terminal per request, the natural `finished` entry included.

The index by identity exists for the client table: a client whose last request or route
ends is told (`released`), so its per-client state can be freed at once (issue 10, 10). It
also keeps what each request was charged when it was claimed (`engined.server.control.budgets`) and
each client's total, so that one client cannot fill the daemon's memory with requests in
flight (issue 21): the total moves only where ownership does.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from engined.core import types as core
from engined.server.ranks.rank_handle import RankHandle

log = structlog.get_logger(__name__)

# (owner, rank, request ids): the requests were ended as "cancelled"; tell the owner.
Notify = Callable[[bytes, int, list[str]], None]
Released = Callable[[bytes], None]


@dataclass(slots=True)
class HandoffRoute:
    rank: int
    identity: bytes
    request_id: str
    # Monotonic time after which the handoff session is abandoned (None: not timed).
    deadline: float | None = None


class Ownership:
    """Owners of the requests of every rank, and the handoff routes, of one control socket."""

    def __init__(
        self,
        loops: Sequence[RankHandle],
        *,
        notify: Notify,
        released: Released,
        handoff_timeout_s: float | None = None,
    ) -> None:
        self._loops = loops
        self._notify = notify
        self._released = released
        self._handoff_timeout_s = handoff_timeout_s
        # request id -> identity, per rank
        self._owners: list[dict[str, bytes]] = [{} for _ in loops]
        self.sources: dict[str, HandoffRoute] = {}
        self.destinations: dict[str, HandoffRoute] = {}
        # request id -> destination handoff id, per rank: the route ends with the request.
        self._destination_requests: list[dict[str, str]] = [{} for _ in loops]
        # identity -> its (rank, request id)s with the bytes each was charged, their sum, and
        # its number of handoff routes.
        # NOTE: requests in the order they were claimed, which is the order of the waiting
        # queue, so cancelling them in turn takes each from the queue's front (in any other
        # order every cancel scans the queue: quadratic).
        self._requests_of: dict[bytes, dict[tuple[int, str], int]] = {}
        self._bytes_of: dict[bytes, int] = {}
        self._routes_of: dict[bytes, int] = {}
        # Set whenever a request stops being owned; shutdown waits on it to drain.
        self.owners_changed = asyncio.Event()

    # --- queries ------------------------------------------------------------------------

    def owner(self, rank: int, request_id: str) -> bytes | None:
        return self._owners[rank].get(request_id)

    def owners_on(self, rank: int) -> dict[str, bytes]:
        """The owner of every request owned on `rank` (the live dict: do not keep or change
        it; a dict, for the compiled `route_outputs`)."""
        return self._owners[rank]

    def ranks_owning(self, request_id: str) -> list[int]:
        return [rank for rank, owners in enumerate(self._owners) if request_id in owners]

    def holds(self, identity: bytes) -> bool:
        """Whether the client owns a request or a route (something may still be sent to it)."""
        return identity in self._requests_of or identity in self._routes_of

    def owned_requests(self) -> int:
        return sum(len(owners) for owners in self._owners)

    def clients(self) -> int:
        """Identities owning something (the size of the per-identity index)."""
        return len(self._requests_of.keys() | self._routes_of.keys())

    def inflight_bytes(self, identity: bytes) -> int:
        """What the requests `identity` owns were charged, together (0 when it owns none)."""
        return self._bytes_of.get(identity, 0)

    # --- taking and giving up ownership -------------------------------------------------

    def claim(self, rank: int, request_id: str, identity: bytes, cost: int = 0) -> bool:
        """Own `request_id` on `rank` before its command is sent, charging `identity` `cost`
        bytes until it ends; False if already owned."""
        owners = self._owners[rank]
        if request_id in owners:
            return False
        owners[request_id] = identity
        self._requests_of.setdefault(identity, {})[rank, request_id] = cost
        self._bytes_of[identity] = self._bytes_of.get(identity, 0) + cost
        return True

    def disown(self, rank: int, request_id: str, identity: bytes) -> None:
        """The core refused the request: it never started, so nothing is sent."""
        if self._owners[rank].get(request_id) == identity:
            self._forget(rank, request_id)
            self._settle(identity)

    def finished(self, rank: int, request_id: str) -> None:
        """The request completed; its last output entry is its terminal.

        The owner is not released: the caller still has that entry to send, and settles
        the client afterwards.
        """
        self._forget(rank, request_id)

    def add_route(
        self, routes: dict[str, HandoffRoute], handoff_id: str, route: HandoffRoute
    ) -> None:
        routes[handoff_id] = route
        self._routes_of[route.identity] = self._routes_of.get(route.identity, 0) + 1
        if routes is self.destinations:
            self._destination_requests[route.rank][route.request_id] = handoff_id
            route.deadline = self.handoff_deadline()

    def drop_route(self, routes: dict[str, HandoffRoute], handoff_id: str) -> HandoffRoute | None:
        """The handoff session ended (released, cancelled, timed out); the route, if any."""
        route = self._drop_route(routes, handoff_id)
        if route is not None:
            self._settle(route.identity)
        return route

    def _drop_route(self, routes: dict[str, HandoffRoute], handoff_id: str) -> HandoffRoute | None:
        route = routes.pop(handoff_id, None)
        if route is None:
            return None
        if routes is self.destinations:
            requests = self._destination_requests[route.rank]
            if requests.get(route.request_id) == handoff_id:
                del requests[route.request_id]
        left = self._routes_of[route.identity] - 1
        if left:
            self._routes_of[route.identity] = left
        else:
            del self._routes_of[route.identity]
        return route

    def _settle(self, identity: bytes) -> None:
        if not self.holds(identity):
            self._released(identity)

    def _forget(self, rank: int, request_id: str) -> bytes | None:
        """Drop the request's owner and any destination route it had; the owner, if any.

        Does not release the owner, so its state (its framing) outlives the terminal that
        the caller sends next.
        """
        identity = self._owners[rank].pop(request_id, None)
        if identity is None:
            return None
        self.owners_changed.set()
        mine = self._requests_of[identity]
        cost = mine.pop((rank, request_id), 0)
        if mine:
            self._bytes_of[identity] -= cost
        else:
            del self._requests_of[identity]
            del self._bytes_of[identity]
        handoff_id = self._destination_requests[rank].get(request_id)
        if handoff_id is not None:
            self._drop_route(self.destinations, handoff_id)
        return identity

    # --- ending requests: the one place -------------------------------------------------

    def end(self, rank: int, request_id: str, *, in_core: bool = False) -> bool:
        """End an owned request early; its owner gets one `cancelled` terminal.

        `in_core`: the request is still in the core, which is told to cancel it at the next
        pass boundary (after any command already queued for it). False when the core
        already dropped it (an applied cancel). Returns whether the request was owned.
        """
        identity = self._forget(rank, request_id)
        if identity is None:
            return False
        if in_core:
            self._loops[rank].send(core.Cancel(request_id))
        self._notify(identity, rank, [request_id])
        self._settle(identity)
        return True

    def end_ended(self, rank: int, ended: Sequence[core.EndedRequest]) -> None:
        """A handoff command or timeout dropped these requests; their owners are told."""
        for request in ended:
            self.end(rank, request.request_id)

    def end_client(self, identity: bytes) -> int:
        """End every request `identity` owns, on every rank (it was dropped); the count."""
        mine = list(self._requests_of.get(identity, ()))
        per_rank: dict[int, list[str]] = {}
        for rank, request_id in mine:
            self._forget(rank, request_id)
            self._loops[rank].send(core.Cancel(request_id))
            per_rank.setdefault(rank, []).append(request_id)
        for rank, request_ids in per_rank.items():
            self._notify(identity, rank, request_ids)
        self._settle(identity)
        return len(mine)

    async def end_all(self) -> None:
        """End every request still owned (shutdown after the drain timeout).

        The owners are told once their ranks have applied the cancels, as for a `cancel`:
        a submit still queued at its rank is applied first and answered `submitted`, so its
        terminal follows that reply instead of preceding it. A request that completes or
        is refused meanwhile ends that way, and is not told twice.
        """
        applied = []
        for rank, owners in enumerate(self._owners):
            if owners:
                *first, last = owners
                loop = self._loops[rank]
                for request_id in first:
                    loop.send(core.Cancel(request_id))
                applied.append(loop.call(core.Cancel(last)))
        await asyncio.gather(*applied)
        for rank, owners in enumerate(self._owners):
            per_owner: dict[bytes, list[str]] = {}
            for request_id, identity in list(owners.items()):
                self._forget(rank, request_id)
                per_owner.setdefault(identity, []).append(request_id)
            for identity, request_ids in per_owner.items():
                self._notify(identity, rank, request_ids)
                self._settle(identity)

    # --- handoff session timeout -------------------------------------------------------

    def handoff_deadline(self) -> float | None:
        timeout = self._handoff_timeout_s
        return None if timeout is None else time.monotonic() + timeout

    async def expire_handoffs(self) -> None:
        """Abandon handoff sessions whose coordinator went quiet (handoff_session_timeout_ms).

        A held source not released, or a destination not activated, within the timeout is
        cancelled as if the coordinator had sent cancel_source / cancel_destination, so a
        vanished coordinator cannot pin KV blocks for the lifetime of the daemon.
        """
        timeout = self._handoff_timeout_s
        if timeout is None:
            return
        interval = min(1.0, timeout / 2)
        while True:
            await asyncio.sleep(interval)
            now = time.monotonic()
            for routes, command in (
                (self.sources, core.CancelSource),
                (self.destinations, core.CancelDestination),
            ):
                for handoff_id, route in list(routes.items()):
                    if route.deadline is None or route.deadline > now:
                        continue
                    route.deadline = None
                    loop = self._loops[route.rank]
                    report = await loop.call(command(handoff_id))
                    if isinstance(report.result, core.Applied) and routes.get(handoff_id) is route:
                        self.drop_route(routes, handoff_id)
                        self.end_ended(route.rank, report.ended)
                        log.warning(
                            "handoff timed out", handoff_id=handoff_id, request_id=route.request_id
                        )
