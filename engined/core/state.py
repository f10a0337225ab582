"""Request records and the waiting/running queues of one engine."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engined.core.sequence import Sequence
from engined.core.types import OffloadWait, RequestStatus

__all__ = ["RequestState", "RequestStatus", "SchedulerState"]


@dataclass(slots=True, eq=False)
class RequestState:
    request_id: str
    seq: Sequence
    status: RequestStatus
    num_computed_tokens: int = 0
    num_preemptions: int = 0
    # Prefix tokens found at the first admission; reported once, on the first output.
    cached_prefix_tokens: int | None = None
    cached_tokens_reported: bool = False
    # Set while an allocation of this request waits on a G1->G2 offload (offload tiers only).
    offload_wait: OffloadWait | None = None

    def prompt_is_prebuilt(self) -> bool:
        """An activated destination: its prompt KV arrived by transfer, nothing to prefill."""
        n = self.seq.num_input_tokens
        return self.num_computed_tokens >= n and self.seq.num_allocated_tokens >= n

    def offload_wait_live(self, refresh: Callable[[OffloadWait], OffloadWait | None]) -> bool:
        """Refresh the offload wait with `refresh`; True while its offload is in flight."""
        wait = self.offload_wait
        if wait is None:
            return False
        self.offload_wait = fresh = refresh(wait)
        return fresh is not None

    def take_cached_tokens(self) -> int | None:
        """The prefix hit to report on this request's first output; None afterwards."""
        if self.cached_tokens_reported:
            return None
        self.cached_tokens_reported = True
        return self.cached_prefix_tokens


class SchedulerState:
    """FIFO waiting queue, ordered running list, and the request records behind both.

    Both queues are kept exact (no stale entries): a request leaves its queue when it leaves
    the state, so a re-submitted id can never resurface at its old position.
    """

    __slots__ = ("preemptions_total", "requests", "running", "running_members", "waiting")

    def __init__(self) -> None:
        self.waiting: deque[str] = deque()
        self.running: list[str] = []
        self.running_members: set[str] = set()
        self.requests: dict[str, RequestState] = {}
        self.preemptions_total = 0

    def enqueue(self, state: RequestState) -> None:
        """A new (or newly activated) request joins the back of the waiting queue."""
        self.requests[state.request_id] = state
        self.push_waiting(state.request_id)

    def push_waiting(self, request_id: str) -> None:
        self.waiting.append(request_id)

    def prepend_waiting(self, request_id: str) -> None:
        self.waiting.appendleft(request_id)

    def remove_waiting(self, request_id: str) -> None:
        waiting = self.waiting
        if waiting and waiting[0] == request_id:
            waiting.popleft()
        elif request_id in waiting:
            waiting.remove(request_id)

    def next_waiting(self, prefer_prebuilt: bool) -> str | None:
        """The FIFO head; while destinations are pending, the first prebuilt request instead."""
        if prefer_prebuilt:
            requests = self.requests
            for request_id in self.waiting:
                if requests[request_id].prompt_is_prebuilt():
                    return request_id
            return None
        return self.waiting[0] if self.waiting else None

    def transition_to_running(self, request_id: str) -> None:
        self.remove_waiting(request_id)
        self.running.append(request_id)
        self.running_members.add(request_id)
        self.requests[request_id].status = RequestStatus.RUNNING

    def remove_running(self, request_id: str) -> None:
        if request_id in self.running_members:
            self.running_members.discard(request_id)
            self.running.remove(request_id)

    def take(self, request_id: str) -> RequestState:
        """Remove a request from the state entirely."""
        req = self.requests.pop(request_id)
        if request_id in self.running_members:
            self.running_members.discard(request_id)
            self.running.remove(request_id)
        else:
            self.remove_waiting(request_id)
        return req
