"""Ownership records of disaggregated handoffs on one core.

Source side (prefill worker): a registered source runs as a normal request; when it completes
its KV is *held* (request gone, blocks still active) until the coordinator releases it.
Destination side (decode worker): a reservation waits in a strict FIFO until its prompt's
blocks can be reserved, is *held* until the transfer is done, and once activated runs as a
prebuilt request. Each record exists exactly once, so every release frees exactly once.

`HandoffBook` groups the four tables of one engine. Pending and held destinations are
queued decodes for FPM, so they keep the decode tally (engined/core/queued.py) as they
change.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from engined.core.errors import HandoffConflictError, handoff_repr
from engined.core.kv_cache import DestinationReservation
from engined.core.queued import LengthTally
from engined.core.sequence import BlockMove
from engined.core.state import RequestState
from engined.core.views import SourceStage


@dataclass(slots=True, eq=False)
class SourceHold:
    handoff_id: str
    request_id: str
    stage: SourceStage = SourceStage.PENDING
    # The Deref moves of the completed request, applied on release.
    release_moves: list[BlockMove] | None = None


class SourceHolds:
    __slots__ = ("by_handoff", "by_request")

    def __init__(self) -> None:
        self.by_handoff: dict[str, SourceHold] = {}
        self.by_request: dict[str, SourceHold] = {}

    def __len__(self) -> int:
        return len(self.by_handoff)

    def validate(self, request_id: str, handoff_id: str) -> None:
        if request_id in self.by_request:
            raise HandoffConflictError(f"source hold already active for request {request_id}")
        if handoff_id in self.by_handoff:
            raise HandoffConflictError(f"handoff {handoff_repr(handoff_id)} is already active")

    def register(self, request_id: str, handoff_id: str) -> None:
        self.validate(request_id, handoff_id)
        hold = SourceHold(handoff_id, request_id)
        self.by_handoff[handoff_id] = hold
        self.by_request[request_id] = hold

    def hold(self, request_id: str, release_moves: list[BlockMove]) -> str | None:
        """The request completed: keep its KV if it is a registered source (returns its id)."""
        hold = self.by_request.get(request_id)
        if hold is None:
            return None
        hold.stage = SourceStage.HELD
        hold.release_moves = release_moves
        return hold.handoff_id

    def pop(self, handoff_id: str) -> SourceHold | None:
        hold = self.by_handoff.pop(handoff_id, None)
        if hold is not None:
            del self.by_request[hold.request_id]
        return hold

    def discard_request(self, request_id: str) -> None:
        """A pending source's request was dropped: forget the registration."""
        hold = self.by_request.get(request_id)
        if hold is not None and hold.stage is SourceStage.PENDING:
            self.pop(hold.handoff_id)


@dataclass(slots=True, eq=False)
class PendingDestination:
    handoff_id: str
    request: RequestState
    # Capacity generation of the last failed reservation attempt; retried only after a change.
    attempted_generation: int | None = None


class PendingDestinations:
    """Strict FIFO of destinations waiting for KV capacity (queued decodes of their prompt)."""

    __slots__ = ("_tally", "by_request", "queue")

    def __init__(self, tally: LengthTally) -> None:
        self.queue: OrderedDict[str, PendingDestination] = OrderedDict()
        self.by_request: dict[str, str] = {}
        self._tally = tally

    def __len__(self) -> int:
        return len(self.queue)

    def __contains__(self, handoff_id: object) -> bool:
        return handoff_id in self.queue

    def validate(self, request_id: str, handoff_id: str) -> None:
        if request_id in self.by_request:
            raise HandoffConflictError(f"destination request {request_id} is already pending")
        if handoff_id in self.queue:
            raise HandoffConflictError(
                f"destination handoff {handoff_repr(handoff_id)} is already pending"
            )

    def push(self, handoff_id: str, request: RequestState) -> None:
        self.queue[handoff_id] = PendingDestination(handoff_id, request)
        self.by_request[request.request_id] = handoff_id
        self._tally.add(request.seq.num_input_tokens)

    def front_due(self, generation: int) -> PendingDestination | None:
        if not self.queue:
            return None
        head = next(iter(self.queue.values()))
        return None if head.attempted_generation == generation else head

    def mark_front_attempted(self, generation: int) -> None:
        if self.queue:
            next(iter(self.queue.values())).attempted_generation = generation

    def pop(self, handoff_id: str) -> PendingDestination | None:
        entry = self.queue.pop(handoff_id, None)
        if entry is not None:
            del self.by_request[entry.request.request_id]
            self._tally.remove(entry.request.seq.num_input_tokens)
        return entry


@dataclass(slots=True, eq=False)
class HeldDestination:
    handoff_id: str
    request: RequestState
    reservation: DestinationReservation


class DestinationHolds:
    """Destinations holding KV until activated (queued decodes of their prompt)."""

    __slots__ = ("_tally", "by_handoff", "by_request")

    def __init__(self, tally: LengthTally) -> None:
        self.by_handoff: dict[str, HeldDestination] = {}
        self.by_request: dict[str, str] = {}
        self._tally = tally

    def __len__(self) -> int:
        return len(self.by_handoff)

    def __contains__(self, handoff_id: object) -> bool:
        return handoff_id in self.by_handoff

    def validate(self, request_id: str, handoff_id: str) -> None:
        if request_id in self.by_request:
            raise HandoffConflictError(
                f"destination reservation already exists for request {request_id}"
            )
        if handoff_id in self.by_handoff:
            raise HandoffConflictError(
                f"destination handoff {handoff_repr(handoff_id)} is already active"
            )

    def insert(self, held: HeldDestination) -> None:
        self.by_handoff[held.handoff_id] = held
        self.by_request[held.request.request_id] = held.handoff_id
        self._tally.add(held.request.seq.num_input_tokens)

    def pop(self, handoff_id: str) -> HeldDestination | None:
        held = self.by_handoff.pop(handoff_id, None)
        if held is not None:
            del self.by_request[held.request.request_id]
            self._tally.remove(held.request.seq.num_input_tokens)
        return held


class ActiveDestinations:
    """Activated destinations still running here, so a cancel can reach them."""

    __slots__ = ("by_handoff", "by_request")

    def __init__(self) -> None:
        self.by_handoff: dict[str, str] = {}
        self.by_request: dict[str, str] = {}

    def __len__(self) -> int:
        return len(self.by_handoff)

    def __contains__(self, handoff_id: object) -> bool:
        return handoff_id in self.by_handoff

    def insert(self, handoff_id: str, request_id: str) -> None:
        self.by_handoff[handoff_id] = request_id
        self.by_request[request_id] = handoff_id

    def pop_handoff(self, handoff_id: str) -> str | None:
        request_id = self.by_handoff.pop(handoff_id, None)
        if request_id is not None:
            del self.by_request[request_id]
        return request_id

    def discard_request(self, request_id: str) -> None:
        handoff_id = self.by_request.pop(request_id, None)
        if handoff_id is not None:
            del self.by_handoff[handoff_id]


class HandoffBook:
    """The handoff tables of one engine: sources, pending, held and active destinations."""

    __slots__ = ("active", "held", "pending", "sources")

    def __init__(self, decode_tally: LengthTally) -> None:
        self.sources = SourceHolds()
        self.pending = PendingDestinations(decode_tally)
        self.held = DestinationHolds(decode_tally)
        self.active = ActiveDestinations()

    def is_idle(self) -> bool:
        """No handoff record at all (one of the conditions of `Engine.is_drained`)."""
        return not (self.sources or self.pending or self.held or self.active)

    def knows_request(self, request_id: str) -> bool:
        """Whether a handoff record names `request_id` (a new request may not reuse it)."""
        return (
            request_id in self.sources.by_request
            or request_id in self.pending.by_request
            or request_id in self.held.by_request
            or request_id in self.active.by_request
        )
