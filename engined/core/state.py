"""Request records and the waiting/running queues of one engine."""

from __future__ import annotations

import heapq
from collections import OrderedDict
from collections.abc import Callable, KeysView
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
    # The sequence length of its last one-token decode schedule: what the pass's FPM counts
    # for it (the request itself stands in `PassContext.scheduled`, so no int is boxed).
    scheduled_len: int = 0
    # vLLM's request priority (lower first) and the order it arrived in: the waiting order
    # and the preemption victim under `scheduling_policy = priority`.
    priority: int = 0
    arrival: int = 0
    # Async scheduling (engined/core/paged/async_batches.py), as vLLM's `Request` counts
    # them: tokens sampled by batches in flight (included in `num_computed_tokens`), tokens
    # of batches in flight, and of those the ones a preemption made stale; whether that
    # stale output is dropped rather than delivered (a cache reset's preemption).
    num_output_placeholders: int = 0
    num_in_flight_tokens: int = 0
    num_stale_output_tokens: int = 0
    drop_stale_output: bool = False
    # vLLM semantics, fused walk: below this length a decode step is steady (its slot in a
    # held block, filling none; its token ends nothing); 0 when unknown.
    # engined/core/paged/scheduler.py sets it, a preemption clears it.
    steady_until: int = 0
    # vLLM's `Request.is_prefill_chunk`: its last schedule left part of what it lacked (a
    # partial prefill). vLLM semantics set it; `prefill_schedule_interval` reads it.
    is_prefill_chunk: bool = False
    # MTP under vLLM semantics (engined/core/paged/spec_decode.py): the draft tokens proposed
    # after its last step (vLLM's `len(spec_token_ids)`), and those its current schedule
    # verifies, `padded` when they are vLLM's placeholders (never accepted).
    spec_tokens: int = 0
    scheduled_drafts: int = 0
    padded_drafts: bool = False
    # Its own stream MTP's acceptance draws from (engined/core/token_stream.py).
    acceptance: Callable[[], float] | None = None
    # vLLM's `kv_cache_report_mode` "full": each admission stores its prefix hit again
    # (engined/core/paged/hit_reports.py).
    report_hits: bool = False

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

    The waiting queue is an insertion-ordered dict, so a cancel or a park anywhere in it is
    O(1) like the head pop and both appends. Beside it, the prebuilt waiting requests are kept
    in the same order: while a destination is pending only they may be admitted, and finding
    the first one by walking the queue made every pass O(waiting) on a decode engine.
    Requests enter the queue only at its two ends, so the index keeps queue order by entering
    them at the same end. Whether a request is prebuilt is taken on entry: its computed and
    allocated tokens change only while it runs, before an activated destination is queued, and
    in preemption before the victim is queued again (a failed admission keeps neither).

    `deferred` is vLLM's `deferred_waiting`: the waiting requests an admission scan passed
    over (`skip_waiting`, a LoRA adapter beyond `max_loras`), until one admits them or they
    leave; the scan puts them back at the front (`requeue_skipped`), as vLLM's
    `skip_request` does.
    """

    __slots__ = (
        "_heap",
        "_prebuilt",
        "_queue",
        "deferred",
        "preemptions_total",
        "requests",
        "running",
        "running_members",
    )

    def __init__(self, *, priority: bool = False) -> None:
        self._queue: OrderedDict[str, None] = OrderedDict()
        # Under `scheduling_policy = priority` the head is the least (priority, arrival) of
        # the queue, as vLLM's PriorityRequestQueue orders requests (whose ties go to the
        # earlier arrival). Entries of requests that left are dropped when they surface.
        self._heap: list[tuple[int, int, str]] | None = [] if priority else None
        self._prebuilt: OrderedDict[str, None] = OrderedDict()
        # The running requests' records, in order: the pass walks them without a lookup per
        # request; `running_members` holds their ids.
        self.running: list[RequestState] = []
        self.running_members: set[str] = set()
        self.requests: dict[str, RequestState] = {}
        self.preemptions_total = 0
        self.deferred: set[str] = set()

    @property
    def waiting(self) -> KeysView[str]:
        """The waiting request ids, in queue order."""
        return self._queue.keys()

    def enqueue(self, state: RequestState) -> None:
        """A new (or newly activated) request joins the back of the waiting queue."""
        self.requests[state.request_id] = state
        self.push_waiting(state.request_id)

    def push_waiting(self, request_id: str) -> None:
        self._queue[request_id] = None
        req = self.requests[request_id]
        if self._heap is not None:
            heapq.heappush(self._heap, (req.priority, req.arrival, request_id))
        if req.prompt_is_prebuilt():
            self._prebuilt[request_id] = None

    def prepend_waiting(self, request_id: str) -> None:
        queue = self._queue
        queue[request_id] = None
        queue.move_to_end(request_id, last=False)
        req = self.requests[request_id]
        if self._heap is not None:
            heapq.heappush(self._heap, (req.priority, req.arrival, request_id))
        if req.prompt_is_prebuilt():
            prebuilt = self._prebuilt
            prebuilt[request_id] = None
            prebuilt.move_to_end(request_id, last=False)

    def remove_waiting(self, request_id: str) -> None:
        queue = self._queue
        if request_id in queue:
            del queue[request_id]
            prebuilt = self._prebuilt
            if request_id in prebuilt:
                del prebuilt[request_id]

    def next_waiting(self, prefer_prebuilt: bool) -> str | None:
        """The head (FIFO, or by priority); while destinations are pending, the first prebuilt
        request instead."""
        heap = self._heap
        if heap is not None and not prefer_prebuilt:
            queue = self._queue
            while heap:
                request_id = heap[0][2]
                if request_id in queue:
                    return request_id
                heapq.heappop(heap)
            return None
        for request_id in self._prebuilt if prefer_prebuilt else self._queue:
            return request_id
        return None

    def has_prebuilt_waiting(self) -> bool:
        """Whether a waiting request's prompt is built already (its KV is here)."""
        return bool(self._prebuilt)

    def skip_waiting(self, request_id: str) -> None:
        """Take a waiting request out of the queue for the rest of an admission scan, and
        count it deferred."""
        self.remove_waiting(request_id)
        self.deferred.add(request_id)

    def requeue_skipped(self, skipped: list[str]) -> None:
        """Put the requests a scan skipped back at the front of the queue, in their order."""
        for request_id in reversed(skipped):
            self.prepend_waiting(request_id)

    def transition_to_running(self, request_id: str) -> None:
        self.deferred.discard(request_id)
        self.remove_waiting(request_id)
        req = self.requests[request_id]
        self.running.append(req)
        self.running_members.add(request_id)
        req.status = RequestStatus.RUNNING

    def remove_running(self, request_id: str) -> None:
        if request_id in self.running_members:
            self._leave_running(request_id)

    def take(self, request_id: str) -> RequestState:
        """Remove a request from the state entirely."""
        self.deferred.discard(request_id)
        if request_id in self.running_members:
            self._leave_running(request_id)
        else:
            self.remove_waiting(request_id)
        return self.requests.pop(request_id)

    def _leave_running(self, request_id: str) -> None:
        self.running_members.discard(request_id)
        # RequestState compares by identity (eq=False): this removes exactly this record.
        self.running.remove(self.requests[request_id])
