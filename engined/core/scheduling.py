"""The scheduling half of a pass: which requests compute how many tokens (vLLM's `schedule()`).

1. Running requests first, in order, each taking up to its remaining tokens from the budget
   (a decoding request takes the one token it sampled last pass). A request whose blocks
   cannot be allocated preempts the newest running request (LIFO; FIFO configurable), which
   may be itself.
2. Waiting requests in strict FIFO order, only if nothing was preempted in step 1: the head
   must pass the admission gate or it blocks everyone behind it; a fresh request larger than
   the whole pool is rejected. While a destination waits for KV, only prebuilt (activated)
   requests are admitted.

With offload tiers, an allocation that evicts blocks still being copied out waits on that
offload instead of preempting, and a fresh request whose prefix sits in G2/G3 is parked on
an onboard (engined/core/offload/parking.py).

Everything the pass accumulates goes into its `PassContext`; the scheduler keeps no pass
state of its own.
"""

from __future__ import annotations

import enum
from typing import NamedTuple

from engined.core.args import EngineArgs
from engined.core.finish import Finisher
from engined.core.handoff_book import PendingDestinations
from engined.core.kv_manager import KvManager
from engined.core.named_tuples import new_tuple
from engined.core.offload.parking import OnboardParking, ParkOutcome
from engined.core.pass_context import PassContext
from engined.core.perf_model import PerfModel
from engined.core.policy import AdmissionPolicy, Decision
from engined.core.preemption import Preempter
from engined.core.prefix_hit import PrefillCost
from engined.core.state import SchedulerState
from engined.core.types import Admission, RequestStatus


class ScheduleOutcome(enum.Enum):
    SCHEDULED = "scheduled"  # the request got its share of this pass
    BLOCKED = "blocked"  # it could not (budget, KV, an offload wait): stop this step
    PREEMPTED_ITSELF = "preempted_itself"  # making room preempted the request itself


class Scheduled(NamedTuple):
    """What `_schedule` did for one request."""

    outcome: ScheduleOutcome
    tokens_used: int
    cached_tokens: int


_SCHEDULED = ScheduleOutcome.SCHEDULED
_BLOCKED = ScheduleOutcome.BLOCKED
_PREEMPTED_ITSELF = ScheduleOutcome.PREEMPTED_ITSELF


class Scheduler:
    __slots__ = (
        "_chunked",
        "_counts_prefill",
        "_fast_paths",
        "_finisher",
        "_kv",
        "_max_num_seqs",
        "_parking",
        "_pending",
        "_perf",
        "_policy",
        "_preempter",
        "_state",
        "block_size",
        "max_batched_tokens",
    )

    def __init__(
        self,
        args: EngineArgs,
        *,
        max_num_seqs: int,
        max_batched_tokens: int,
        state: SchedulerState,
        kv: KvManager,
        policy: AdmissionPolicy,
        parking: OnboardParking,
        pending: PendingDestinations,
        finisher: Finisher,
        preempter: Preempter,
        perf: PerfModel,
        fast_paths: bool = True,
    ) -> None:
        self.block_size = args.block_size
        self.max_batched_tokens = max_batched_tokens
        self._max_num_seqs = max_num_seqs
        self._chunked = args.enable_chunked_prefill
        self._counts_prefill = args.prompts_cost_prefill
        self._state = state
        self._kv = kv
        self._policy = policy
        self._parking = parking
        self._pending = pending
        self._finisher = finisher
        self._preempter = preempter
        self._perf = perf
        # Off only in the equivalence test of the hand-inlined decode step.
        self._fast_paths = fast_paths

    def schedule(self, ctx: PassContext) -> None:
        """Steps 1 and 2 of the pass; what they scheduled, admitted and rejected is in `ctx`."""
        if self._kv.offload is not None:
            # The blocks an offload frees belong to the running request that waited for
            # them: no waiting request is admitted in a pass that starts with one (see
            # `_running_waits_on_offload`), as no admission follows a preemption.
            ctx.preempted_any = self._running_waits_on_offload()
        self._schedule_running(ctx)
        self._admit_waiting(ctx)

    def prefill_ms(self, ctx: PassContext) -> float:
        """The modeled duration of the pass's prefill batch (0 without one)."""
        return ctx.prefill_ms(self._perf)

    def _schedule_running(self, ctx: PassContext) -> None:
        """Step 1 of the pass. Decoding requests (one dangling token inside an allocated
        block) take the inline path; everything else goes through `_schedule`."""
        state = self._state
        # Preemption removes entries as the walk goes: hence the index.
        running = state.running
        scheduled = ctx.scheduled
        bs = self.block_size
        fast = self._fast_paths
        i = 0
        while i < len(running) and ctx.budget > 0:
            req = running[i]
            request_id = req.request_id
            seq = req.seq
            computed = req.num_computed_tokens
            length = len(seq.tokens)
            prompt_len = seq.num_input_tokens
            if (
                fast
                and length - computed == 1
                and computed >= prompt_len
                # ceil(length / bs) <= ceil(allocated / bs), as (n - 1) // bs + 1 is the ceil
                # for n >= 0, without the negations.
                and (length - 1) // bs <= (seq.num_allocated_tokens - 1) // bs
            ):
                # Same result as `_schedule` for this case: no allocation can be needed.
                if length > seq.num_allocated_tokens:
                    seq.num_allocated_tokens = length
                req.num_computed_tokens = length
                # A decode of one token: the request, by its length, stands for its
                # ScheduledWork.
                req.scheduled_len = length
                scheduled.append(req)
                ctx.budget -= 1
                i += 1
                continue
            outcome = self._schedule(ctx, request_id, False, None).outcome
            if outcome is _SCHEDULED:
                i += 1
            elif outcome is _BLOCKED:
                break

    def _running_waits_on_offload(self) -> bool:
        """Whether a running request waits on an offload, or its offload just ended.

        NOTE: deviation from upstream. In 1.3.0 the request whose growth evicted blocks
        waits for their copy to G2 while the waiting queue is admitted first in the next
        pass: a request preempted to make that room is re-admitted onto the freed blocks,
        preempted again when the waiter grows, and the two livelock (neither ever emits).
        vLLM schedules running requests' new blocks before any admission; holding
        admission back for that one pass does the same here. Refreshes the waits.
        """
        refresh = self._kv.refresh_offload_wait
        waited = False
        for req in self._state.running:
            if req.offload_wait is not None:
                waited = True
                req.offload_wait_live(refresh)
        return waited

    def _admit_waiting(self, ctx: PassContext) -> None:
        state = self._state
        requests = state.requests
        kv = self._kv
        pending_head = bool(self._pending)
        tiers = kv.offload is not None
        refresh = kv.refresh_offload_wait
        while not ctx.preempted_any and len(state.running_members) < self._max_num_seqs:
            request_id = state.next_waiting(pending_head)
            if request_id is None:
                break
            req = requests[request_id]
            if tiers and req.offload_wait_live(refresh):
                break
            cost: PrefillCost | None
            if req.prompt_is_prebuilt():
                n = req.seq.num_input_tokens
                cost = PrefillCost(0, 0, n, n)
            elif pending_head:
                break
            else:
                running_seqs = (r.seq for r in state.running)
                decision, cost = self._policy.decide(
                    req.seq, req.status is RequestStatus.WAITING, kv, running_seqs
                )
                if decision is Decision.WAIT:
                    break
                if decision is Decision.REJECT:
                    ctx.rejected.append(request_id)
                    self._finisher.drop(request_id)
                    continue
                if tiers and req.status is RequestStatus.WAITING:
                    assert cost is not None
                    parked = self._parking.try_park(req, ctx.now_ms, cost)
                    if parked is ParkOutcome.PARKED:
                        continue
                    if parked is ParkOutcome.WAITS_ON_OFFLOAD:
                        break
            outcome, tokens_used, cached = self._schedule(ctx, request_id, True, cost)
            if outcome is not _SCHEDULED:
                break
            ctx.admissions.append(Admission(request_id, cached))
            if tokens_used == 0 and ctx.budget == 0:
                break

    def _schedule(
        self, ctx: PassContext, request_id: str, from_waiting: bool, cost: PrefillCost | None
    ) -> Scheduled:
        """Give one request its share of this pass."""
        req = self._state.requests[request_id]
        seq = req.seq
        kv = self._kv
        if req.num_computed_tokens == 0:
            cached = (cost if cost is not None else kv.prefill_cost(seq)).cached_tokens
        else:
            cached = 0
        before = req.num_computed_tokens + cached
        prompt_len = seq.num_input_tokens
        prompt_before = min(before, prompt_len)
        length = len(seq.tokens)
        remaining = max(length - before, 0)
        budget = ctx.budget
        prompt_remaining = prompt_len - prompt_before
        if prompt_remaining > 0 and not self._chunked and prompt_remaining > budget:
            return new_tuple(Scheduled, (_BLOCKED, 0, cached))
        desired = min(remaining, budget)
        if desired == 0 and remaining > 0:
            return new_tuple(Scheduled, (_BLOCKED, 0, cached))
        if req.offload_wait is not None and req.offload_wait_live(kv.refresh_offload_wait):
            return new_tuple(Scheduled, (_BLOCKED, 0, cached))
        target = before + desired
        actual = target
        while True:
            if target <= seq.num_allocated_tokens:
                break
            use = seq.prepare_allocation(target)
            if use is None or kv.use(use, ctx.now_ms):
                seq.num_allocated_tokens = target
                break
            wait = kv.take_offload_wait()
            if wait is not None:
                # The eviction this allocation needs is being offloaded: wait for it.
                req.offload_wait = wait
                actual = before
                break
            victim = self._preempter.preempt()
            if victim is None:
                actual = before
                break
            ctx.preempted_any = True
            ctx.unschedule(victim, self._counts_prefill)
            if victim == request_id:
                return new_tuple(Scheduled, (_PREEMPTED_ITSELF, 0, cached))
        tokens_used = actual - before
        if tokens_used == 0 and actual < length:
            # A waiting request that could not start keeps no computed tokens: its prefix
            # hit is looked up again at its next admission, and reported then.
            if not from_waiting:
                req.num_computed_tokens = actual
            return new_tuple(Scheduled, (_BLOCKED, 0, cached))
        req.num_computed_tokens = actual
        prompt_tokens = min(actual, prompt_len) - prompt_before
        # Once a pass: a preemption stops admission for the rest of the pass
        # (`preempted_any`), so a preempted request is never scheduled twice.
        last = seq.generated >= seq.max_output_tokens
        ctx.add_work(
            request_id,
            tokens_used,
            prompt_before,
            prompt_tokens,
            prompt_len,
            length,
            last,
            self._counts_prefill,
        )
        if from_waiting:
            self._state.transition_to_running(request_id)
            if req.cached_prefix_tokens is None:
                req.cached_prefix_tokens = cached
            ctx.cache_queries += length
            ctx.cache_hits += cached
        ctx.budget = budget - tokens_used
        return new_tuple(Scheduled, (_SCHEDULED, tokens_used, cached))
