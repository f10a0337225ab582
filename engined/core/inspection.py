"""Read-only snapshots of one rank for tests and tools: a request wherever the engine holds
it, a handoff's two sides, the queues in order.

Apart from engine.py because nothing on the hot path reads them; the engine's `inspect`,
`inspect_handoff` and `queues` hand their parts to these functions.
"""

from __future__ import annotations

from engined.core.assembly import EngineParts
from engined.core.state import RequestState
from engined.core.views import DestinationStage, HandoffView, QueueView, RequestPlace, RequestView


def inspect_request(parts: EngineParts, request_id: str) -> RequestView | None:
    """A snapshot of one request, wherever the engine holds it; None if it does not."""
    state = parts.state
    req = state.requests.get(request_id)
    if req is not None:
        if request_id in state.running_members:
            place = RequestPlace.RUNNING
        elif request_id in parts.parking:
            place = RequestPlace.PARKED
        else:
            place = RequestPlace.WAITING
        return _view(parts, req, place)
    book = parts.book
    handoff_id = book.pending.by_request.get(request_id)
    if handoff_id is not None:
        pending = book.pending.queue[handoff_id].request
        return _view(parts, pending, RequestPlace.PENDING_DESTINATION)
    handoff_id = book.held.by_request.get(request_id)
    if handoff_id is not None:
        return _view(
            parts, book.held.by_handoff[handoff_id].request, RequestPlace.RESERVED_DESTINATION
        )
    return None


def _view(parts: EngineParts, req: RequestState, place: RequestPlace) -> RequestView:
    seq = req.seq
    return RequestView(
        request_id=req.request_id,
        place=place,
        status=req.status,
        prompt_tokens=seq.num_input_tokens,
        num_tokens=len(seq.tokens),
        output_tokens=seq.generated,
        max_output_tokens=seq.max_output_tokens,
        num_computed_tokens=req.num_computed_tokens,
        num_allocated_tokens=seq.num_allocated_tokens,
        num_preemptions=req.num_preemptions,
        cached_prefix_tokens=req.cached_prefix_tokens,
        offload_wait=req.offload_wait,
        block_ids=parts.kv.active_block_ids(seq),
        block_hashes=list(seq.hashes),
        block_keys=list(seq.keys),
        block_parent_keys=[seq.parent_key(pos) for pos in range(len(seq.hashes))],
    )


def inspect_handoff(parts: EngineParts, handoff_id: str) -> HandoffView | None:
    """A snapshot of one handoff this engine takes part in; None if it has no record."""
    book = parts.book
    source = source_request = destination = destination_request = None
    reserved: list[int] = []
    hold = book.sources.by_handoff.get(handoff_id)
    if hold is not None:
        source, source_request = hold.stage, hold.request_id
    pending = book.pending.queue.get(handoff_id)
    held = book.held.by_handoff.get(handoff_id)
    active = book.active.by_handoff.get(handoff_id)
    if pending is not None:
        destination, destination_request = DestinationStage.PENDING, pending.request.request_id
    elif held is not None:
        destination, destination_request = DestinationStage.RESERVED, held.request.request_id
        reserved = held.reservation.block_ids()
    elif active is not None:
        destination, destination_request = DestinationStage.ACTIVE, active
    if source is None and destination is None:
        return None
    return HandoffView(
        handoff_id=handoff_id,
        source=source,
        source_request_id=source_request,
        destination=destination,
        destination_request_id=destination_request,
        reserved_block_ids=reserved,
    )


def queues(parts: EngineParts) -> QueueView:
    """The waiting queue, the running list and the parked requests, in order."""
    return QueueView(
        waiting=list(parts.state.waiting),
        running=[req.request_id for req in parts.state.running],
        parked=[parked.request_id for parked in parts.parking.parked],
        pending_destinations=list(parts.book.pending.queue),
    )
