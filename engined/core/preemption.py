"""Preemption: a running request goes back to the front of the queue, its KV freed.

The victim is the newest running request (LIFO, vLLM's default) or the oldest (FIFO); under
`scheduling_policy = priority`, the running request with the greatest (priority, arrival). A
request waiting on an offload is never the victim: its blocks free up by themselves. The
TRT-LLM no-evict policy never preempts. A preempted request keeps its generated tokens and
recomputes them when it is admitted again.
"""

from __future__ import annotations

from engined.core.capacity import CapacityGeneration
from engined.core.kv_cache import KvCache
from engined.core.policy import AdmissionPolicy
from engined.core.state import RequestState, SchedulerState
from engined.core.types import RequestStatus


def _priority_key(req: RequestState) -> tuple[int, int]:
    return (req.priority, req.arrival)


class Preempter:
    __slots__ = ("_by_priority", "_capacity", "_kv", "_lifo", "_policy", "_state", "victims")

    def __init__(
        self,
        state: SchedulerState,
        kv: KvCache,
        policy: AdmissionPolicy,
        capacity: CapacityGeneration,
        *,
        lifo: bool,
        by_priority: bool = False,
    ) -> None:
        self._state = state
        self._kv = kv
        self._policy = policy
        self._capacity = capacity
        self._lifo = lifo
        self._by_priority = by_priority
        # The victims in order, kept only when a recording engine sets a list (`PassTrace`).
        self.victims: list[str] | None = None

    def preempt(self) -> str | None:
        """Evict one running request back to the front of the queue; its id, or None."""
        if not self._policy.allows_preemption:
            return None
        state = self._state
        kv = self._kv
        order = reversed(state.running) if self._lifo else iter(state.running)
        running = RequestStatus.RUNNING
        if self._by_priority:
            # vLLM's priority policy: the greatest (priority, arrival), wherever it runs.
            req = max(
                (r for r in state.running if r.status is running),
                key=_priority_key,
                default=None,
            )
        elif kv.offload is None:
            req = next((r for r in order if r.status is running), None)
        else:
            refresh = kv.refresh_offload_wait
            req = next(
                (r for r in order if r.status is running and not r.offload_wait_live(refresh)),
                None,
            )
        if req is None:
            return None
        self._evict(req)
        return req.request_id

    def preempt_all(self) -> None:
        """Preempt every running request, last first, whatever the policy: vLLM's
        `reset_prefix_cache(reset_running_requests=True)`, which a pause's cache clear runs,
        so that the requests come back in their running order. What they have in flight
        (async scheduling) is dropped, not delivered: they are resumed at once, and that
        output would come after their recomputed positions."""
        running = self._state.running
        while running:
            self._evict(running[-1], drop_stale_output=True)

    def _evict(self, req: RequestState, *, drop_stale_output: bool = False) -> None:
        victim = req.request_id
        state = self._state
        kv = self._kv
        state.remove_running(victim)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.steady_until = 0
        req.spec_tokens = 0
        # Async scheduling: what is in flight is delivered but no longer counted (or dropped:
        # `drop_stale_output`, which an earlier drop keeps while its share is undrained).
        req.drop_stale_output = drop_stale_output or (
            req.drop_stale_output and req.num_stale_output_tokens > 0
        )
        req.num_stale_output_tokens = req.num_in_flight_tokens
        req.num_output_placeholders = 0
        req.num_preemptions += 1
        state.preemptions_total += 1
        moves = req.seq.reset_with_moves()
        state.prepend_waiting(victim)
        self._capacity.bump()
        kv.free_all(moves)
        if self.victims is not None:
            self.victims.append(victim)
