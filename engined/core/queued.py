"""The queued-request half of a pass's forward-pass metrics, kept as requests queue and leave.

FPM reports, per pass, the count, total and population variance of the lengths of the
queued requests: prefills (fresh prompts) and decodes (preempted requests, activated or
reserved disaggregation destinations). Walking the queues for that made every pass cost
O(waiting requests), so a deep queue slowed every pass even though a pass admits only a few.
Here each queue keeps integer tallies (count, sum, sum of squares), updated when a request
enters or leaves it, and a pass reads them in O(1).

A request's class and length are fixed while it waits (only a running request changes
status or grows), so they are taken once, on entry. The variance is computed exactly from
the integers and rounded once, as every FPM variance is (engined/core/fpm.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from engined.core.fpm import LengthStats, exact_stats
from engined.core.named_tuples import new_tuple
from engined.core.state import RequestState, RequestStatus, SchedulerState


class LengthTally:
    """Count, sum and population variance of a multiset of lengths, in O(1) per change."""

    __slots__ = ("count", "squares", "total")

    def __init__(self) -> None:
        self.count = 0
        self.total = 0
        self.squares = 0

    def add(self, length: int) -> None:
        self.count += 1
        self.total += length
        self.squares += length * length

    def remove(self, length: int) -> None:
        self.count -= 1
        self.total -= length
        self.squares -= length * length

    def summary(self) -> LengthStats:
        """(count, sum, population variance); the variance is 0.0 for no lengths."""
        return exact_stats(self.count, self.total, self.squares)


class QueuedAs(NamedTuple):
    """How FPM counts a queued request: the tally it is in and the length it adds."""

    tally: LengthTally
    length: int


class QueuedLengths:
    """The two FPM tallies of one core: queued prefills and queued decodes."""

    __slots__ = ("decode", "prefill")

    def __init__(self) -> None:
        self.prefill = LengthTally()
        self.decode = LengthTally()


class TalliedState(SchedulerState):
    """SchedulerState whose waiting queue keeps the FPM tallies.

    `queued_as(request)` names a waiting request's class and length, or None for a request
    FPM does not count. It is asked when the request enters the queue.
    """

    __slots__ = ("_counted", "_queued_as")

    def __init__(
        self, queued_as: Callable[[RequestState], QueuedAs | None], *, priority: bool = False
    ) -> None:
        super().__init__(priority=priority)
        self._queued_as = queued_as
        self._counted: dict[str, QueuedAs] = {}

    def push_waiting(self, request_id: str) -> None:
        super().push_waiting(request_id)
        self._count(request_id)

    def prepend_waiting(self, request_id: str) -> None:
        super().prepend_waiting(request_id)
        self._count(request_id)

    def remove_waiting(self, request_id: str) -> None:
        counted = self._counted.pop(request_id, None)
        if counted is not None:
            counted.tally.remove(counted.length)
        super().remove_waiting(request_id)

    def _count(self, request_id: str) -> None:
        counted = self._queued_as(self.requests[request_id])
        if counted is not None:
            self._counted[request_id] = counted
            counted.tally.add(counted.length)


def waiting_class(
    lengths: QueuedLengths, is_active_destination: Callable[[str], bool]
) -> Callable[[RequestState], QueuedAs | None]:
    """How FPM counts a waiting request, as Dynamo's mocker does.

    An activated destination is a decode of its prompt (its KV arrived by transfer); a fresh
    request a prefill of its prompt; a preempted one a decode of everything it has so far.
    """

    def queued_as(req: RequestState) -> QueuedAs | None:
        if is_active_destination(req.request_id):
            return new_tuple(QueuedAs, (lengths.decode, req.seq.num_input_tokens))
        if req.status is RequestStatus.WAITING:
            return new_tuple(QueuedAs, (lengths.prefill, req.seq.num_input_tokens))
        if req.status is RequestStatus.PREEMPTED:
            return new_tuple(QueuedAs, (lengths.decode, len(req.seq.tokens)))
        return None

    return queued_as
