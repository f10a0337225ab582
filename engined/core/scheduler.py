"""VllmCore: one engine pass of the vLLM scheduler that Dynamo's mocker 1.3.0 models.

A pass is vLLM's `schedule()` and `update_from_output()` in one deterministic call:

1. Running requests first, in order, each taking up to its remaining tokens from the budget
   (a decoding request takes the one token it sampled last pass). A request whose blocks
   cannot be allocated preempts the newest running request (LIFO; FIFO configurable), which
   may be itself.
2. Waiting requests in strict FIFO order, only if nothing was preempted in step 1: the head
   must pass the admission gate or it blocks everyone behind it; a fresh request larger than
   the whole pool is rejected.
3. Every running request whose KV has caught up with its tokens samples one token (or an MTP
   burst). The first token comes in the pass that completes the prompt.

Time is data: the caller passes `now_ms`, the result carries the modeled `end_ms`.

With offload tiers (G2 host, G3 disk; `num_g2_blocks` and `kv_bytes_per_token`), every pass
first advances the tiers to `now_ms` and re-queues requests whose lower-tier prefix has
landed (engined/core/offload/parking.py); allocations that evict wait for the evicted blocks to be
copied out instead of preempting (engined/core/offload/g1_glue.py); a pass that could do nothing
but wait for a transfer ends at the transfer's deadline. Without them none of this runs.
"""

from __future__ import annotations

import itertools
import random
import sys

from engined.core.args import EngineArgs, EngineType, PreemptionMode, WorkerType
from engined.core.emission import emit_ready_tokens
from engined.core.errors import UnsupportedError
from engined.core.fpm import ScheduledWork, build_snapshot
from engined.core.handoff import ActiveDestinations, SourceHolds
from engined.core.kv_manager import KvManager, PrefillCost
from engined.core.offload.config import OffloadConfig
from engined.core.offload.parking import BLOCKED as SWAP_IN_BLOCKED
from engined.core.offload.parking import PARKED, SwapInParking
from engined.core.offload.tier_engine import TierEngine
from engined.core.perf_model import make_perf_model, scale_ms
from engined.core.policy import AdmissionPolicy, Decision, TrtllmNoEvictPolicy
from engined.core.prefix_hit import PrefixHit
from engined.core.queued import (
    QueuedLengths,
    TalliedDestinationHolds,
    TalliedPendingDestinations,
    TalliedState,
    waiting_class,
)
from engined.core.speculative import SpeculativeSampler
from engined.core.state import RequestStatus
from engined.core.tiers import TierHandling, tier_metrics
from engined.core.types import (
    Admission,
    EngineMetrics,
    FpmSnapshot,
    KvEvent,
    LifecycleEvent,
    OutputSignal,
    PassResult,
    Request,
    Submit,
    Submitted,
)
from engined.core.vocab import Vocabulary

_UNBOUNDED = sys.maxsize
_MASK64 = (1 << 64) - 1

SCHEDULED = 0
BLOCKED = 1
CURRENT_PREEMPTED = 2


class VllmCore(TierHandling):
    """The scheduler of one data-parallel rank: requests, KV blocks, handoffs, passes."""

    def __init__(self, args: EngineArgs, *, dp_rank: int = 0, worker_id: int = 0) -> None:
        args = args.normalized()
        if args.engine_type is EngineType.SGLANG:
            raise UnsupportedError("engine_type=sglang is not supported by the vLLM core")
        self.args = args
        self.dp_rank = dp_rank
        self.worker_id = worker_id
        self.block_size = args.block_size
        self.num_blocks = args.num_gpu_blocks
        self.max_num_seqs = args.max_num_seqs or _UNBOUNDED
        self.max_batched_tokens = args.max_num_batched_tokens or _UNBOUNDED
        self.caching = args.enable_prefix_caching
        self.worker_type = args.worker_type
        self.is_prefill_worker = args.worker_type is WorkerType.PREFILL
        self.lifo = args.preemption_mode is PreemptionMode.LIFO
        policy_cls = (
            TrtllmNoEvictPolicy if args.engine_type is EngineType.TRTLLM else AdmissionPolicy
        )
        self.policy: AdmissionPolicy = policy_cls(
            args.num_gpu_blocks,
            args.block_size,
            None if args.enable_chunked_prefill else self.max_batched_tokens,
            args.max_model_len,
        )
        self.kv = KvManager(
            args.num_gpu_blocks,
            args.block_size,
            dp_rank=dp_rank,
            publish=args.enable_prefix_caching,
            prefix_hit=PrefixHit.from_args(args),
        )
        self.swap_ins = SwapInParking()
        offload_config = OffloadConfig.from_args(args)
        if offload_config is not None:
            self.kv.attach_offload(TierEngine(offload_config))
        # FPM's queued-request tallies, kept by the queues themselves (engined/core/queued.py).
        self.queued = QueuedLengths()
        self.state = TalliedState(
            waiting_class(self.queued, lambda rid: rid in self.active_destinations.by_request)
        )
        self.rng = random.Random(args.seed * 1_000_003 + dp_rank)
        self.vocab = Vocabulary(self.rng, args.vocab_size, args.excluded_token_ids)
        self._partial_ids = itertools.count().__next__
        self.sampler = (
            SpeculativeSampler(args.nextn_accept_rates, (args.aic_mtp_seed + worker_id) & _MASK64)
            if args.aic_nextn is not None
            else None
        )
        self.perf = make_perf_model(
            args.perf_model,
            prefill_ms_per_token=args.fixed_prefill_ms_per_token,
            pass_overhead_ms=args.fixed_pass_overhead_ms,
            decode_ms_per_pass=args.fixed_decode_ms_per_pass,
        )
        self.source_holds = SourceHolds()
        self.pending_destinations = TalliedPendingDestinations(self.queued.decode)
        self.destination_holds = TalliedDestinationHolds(self.queued.decode)
        self.active_destinations = ActiveDestinations()
        # Bumped whenever capacity may have improved; a pending destination head that failed
        # to reserve is retried only after it moves.
        self.capacity_generation = 0
        self._lifecycle: list[LifecycleEvent] = []
        # Pass-scoped scheduling state.
        self._budget = 0
        self._scheduled: dict[str, ScheduledWork] = {}
        self._batch_count = 0
        self._batch_isl = 0
        self._batch_prefix = 0
        self._preempted_any = False
        self._cache_queries = 0
        self._cache_hits = 0

    # --- requests -----------------------------------------------------------------------

    def receive(self, request: Request) -> str:
        """Submit a request; returns its id. Raises on a duplicate id."""
        result = self.apply_command(Submit(request))
        assert isinstance(result, Submitted)
        return result.request_id

    def is_empty(self) -> bool:
        return not self.state.requests

    def is_drained(self) -> bool:
        return (
            not self.state.requests
            and not self.source_holds
            and not self.pending_destinations
            and not self.destination_holds
            and not self.active_destinations
            and not self.swap_ins
            and self.earliest_offload_deadline() is None
        )

    def num_requests(self) -> int:
        return len(self.state.requests)

    def take_kv_events(self) -> list[KvEvent]:
        return self.kv.take_events()

    def reset_prefix_cache(self) -> bool:
        """Drop the prefix cache (publishes AllBlocksCleared); False while blocks are in use."""
        return self.kv.reset_prefix_cache()

    def request_block_ids(self, request_id: str) -> list[int]:
        return self.kv.active_block_ids(self.state.requests[request_id].seq)

    def metrics(self) -> EngineMetrics:
        kv = self.kv
        active = kv.num_active_blocks()
        waiting = (
            len(self.state.waiting)
            + len(self.pending_destinations)
            + len(self.destination_holds)
            + len(self.swap_ins)
        )
        metrics = EngineMetrics(
            self.dp_rank,
            active,
            kv.num_inactive_blocks(),
            self.num_blocks,
            active / self.num_blocks,
            len(self.state.running_members),
            waiting,
            self.state.preemptions_total,
        )
        return metrics if kv.offload is None else tier_metrics(metrics, kv.offload.engine)

    # --- the pass -----------------------------------------------------------------------

    def execute_pass(self, now_ms: float) -> PassResult:
        state = self.state
        requests_before = len(state.requests)
        self._budget = self.max_batched_tokens
        self._scheduled = {}
        self._batch_count = self._batch_isl = self._batch_prefix = 0
        self._preempted_any = False
        self._cache_queries = self._cache_hits = 0
        offload = self.kv.offload
        if offload is not None:
            self.swap_ins.tick_and_promote(self, now_ms)
            # The blocks an offload frees belong to the running request that waited for
            # them: no waiting request is admitted in a pass that starts with one (see
            # `_running_waits_on_offload`), as no admission follows a preemption.
            self._preempted_any = self._running_waits_on_offload()

        self._schedule_running()

        admissions, rejected = self._admit_waiting(now_ms)

        prefill_ms = 0.0
        if self._batch_count:
            n = self._batch_count
            raw = self.perf.prefill_ms(n, self._batch_isl // n, self._batch_prefix // n)
            prefill_ms = scale_ms(raw, self.args.speedup_ratio)
        decode_start = now_ms + prefill_ms
        decode_ms, signals, forwards, tokens = emit_ready_tokens(self)
        for request_id in rejected:
            signals.append(OutputSignal(request_id, None, True, True))
        end_ms = decode_start + decode_ms
        if offload is not None and end_ms <= now_ms:
            # Stall-advance: nothing took time, so the next thing that can happen is a transfer.
            deadline = offload.engine.earliest_pending_deadline()
            if deadline is not None:
                end_ms = max(deadline, now_ms)
        return PassResult(
            end_ms=end_ms,
            completed_requests=max(requests_before - len(state.requests), 0),
            output_signals=signals,
            admissions=admissions,
            lifecycle_events=self.take_lifecycle_events(),
            metrics=self.metrics(),
            kv_events=self.kv.take_events(),
            fpm=self._fpm((end_ms - now_ms) / 1000.0),
            prefix_cache_queries=self._cache_queries,
            prefix_cache_hits=self._cache_hits,
            accept_length_output_tokens=tokens,
            accept_length_decode_forwards=forwards,
        )

    def _schedule_running(self) -> None:
        """Step 1 of the pass. Decoding requests (one dangling token inside an allocated
        block) take the inline path; everything else goes through `_schedule`."""
        state = self.state
        running = state.running
        requests = state.requests
        scheduled = self._scheduled
        bs = self.block_size
        i = 0
        while i < len(running) and self._budget > 0:
            request_id = running[i]
            req = requests[request_id]
            seq = req.seq
            computed = req.num_computed_tokens
            length = len(seq.tokens)
            prompt_len = seq.num_input_tokens
            if (
                length - computed == 1
                and computed >= prompt_len
                and -(-length // bs) <= -(-seq.num_allocated_tokens // bs)
            ):
                # Same result as `_schedule` for this case: no allocation can be needed.
                if length > seq.num_allocated_tokens:
                    seq.num_allocated_tokens = length
                req.num_computed_tokens = length
                scheduled[request_id] = ScheduledWork(
                    1, 0, prompt_len, prompt_len, length, seq.generated >= seq.max_output_tokens
                )
                self._budget -= 1
                i += 1
                continue
            outcome = self._schedule(request_id, False, None)[0]
            if outcome == SCHEDULED:
                i += 1
            elif outcome == BLOCKED:
                break

    def _running_waits_on_offload(self) -> bool:
        """Whether a running request waits on an offload, or its offload just ended.

        NOTE: deviation from upstream. In 1.3.0 the request whose growth evicted blocks
        waits for their copy to G2 while the waiting queue is admitted first in the next
        pass: a request preempted to make that room is re-admitted onto the freed blocks,
        preempted again when the waiter grows, and the two livelock (neither ever emits).
        vLLM schedules running requests' new blocks before any admission; holding
        admission back for that one pass does the same here. Refreshes the dependencies.
        """
        requests = self.state.requests
        waited = False
        for request_id in self.state.running:
            req = requests[request_id]
            if req.offload_wait is not None:
                waited = True
                self.offload_wait_live(req)
        return waited

    def _admit_waiting(self, now_ms: float) -> tuple[list[Admission], list[str]]:
        state = self.state
        requests = state.requests
        admissions: list[Admission] = []
        rejected: list[str] = []
        pending_head = bool(self.pending_destinations)
        offload = self.kv.offload is not None
        while not self._preempted_any and len(state.running_members) < self.max_num_seqs:
            request_id = state.next_waiting(pending_head)
            if request_id is None:
                break
            req = requests[request_id]
            if offload and self.offload_wait_live(req):
                break
            cost: PrefillCost | None
            if req.prompt_is_prebuilt():
                n = req.seq.num_input_tokens
                cost = PrefillCost(0, 0, n, n)
            elif pending_head:
                break
            else:
                running_seqs = (requests[u].seq for u in state.running)
                decision, cost = self.policy.decide(
                    req.seq, req.status is RequestStatus.WAITING, self.kv, running_seqs
                )
                if decision is Decision.WAIT:
                    break
                if decision is Decision.REJECT:
                    rejected.append(request_id)
                    self.drop_request(request_id)
                    continue
                if offload and req.status is RequestStatus.WAITING:
                    assert cost is not None
                    parked = self.swap_ins.try_park(self, req, now_ms, cost)
                    if parked == PARKED:
                        continue
                    if parked == SWAP_IN_BLOCKED:
                        break
            outcome, tokens_used, cached = self._schedule(request_id, True, cost)
            if outcome != SCHEDULED:
                break
            admissions.append(Admission(request_id, cached))
            if tokens_used == 0 and self._budget == 0:
                break
        return admissions, rejected

    def _schedule(
        self, request_id: str, from_waiting: bool, cost: PrefillCost | None
    ) -> tuple[int, int, int]:
        """Give one request its share of this pass: (outcome, tokens used, cached tokens)."""
        req = self.state.requests[request_id]
        seq = req.seq
        if req.num_computed_tokens == 0:
            cached = (cost if cost is not None else self.kv.prefill_cost(seq)).cached_tokens
        else:
            cached = 0
        before = req.num_computed_tokens + cached
        prompt_len = seq.num_input_tokens
        prompt_before = min(before, prompt_len)
        length = len(seq.tokens)
        remaining = max(length - before, 0)
        budget = self._budget
        prompt_remaining = prompt_len - prompt_before
        if (
            prompt_remaining > 0
            and not self.args.enable_chunked_prefill
            and prompt_remaining > budget
        ):
            return BLOCKED, 0, cached
        desired = min(remaining, budget)
        if desired == 0 and remaining > 0:
            return BLOCKED, 0, cached
        if req.offload_wait is not None and self.offload_wait_live(req):
            return BLOCKED, 0, cached
        target = before + desired
        actual = target
        kv = self.kv
        while True:
            if target <= seq.num_allocated_tokens:
                break
            use = seq.prepare_allocation(target)
            if use is None or kv.use(use):
                seq.num_allocated_tokens = target
                break
            blocked = kv.take_offload_wait()
            if blocked is not None:
                # The eviction this allocation needs is being offloaded: wait for it.
                req.offload_wait = blocked
                actual = before
                break
            victim = self.preempt()
            if victim is None:
                actual = before
                break
            self._preempted_any = True
            self._undo_scheduled(victim)
            if victim == request_id:
                return CURRENT_PREEMPTED, 0, cached
        tokens_used = actual - before
        if tokens_used == 0 and actual < length:
            # A waiting request that could not start keeps no computed tokens: its prefix
            # hit is looked up again at its next admission, and reported then.
            if not from_waiting:
                req.num_computed_tokens = actual
            return BLOCKED, 0, cached
        req.num_computed_tokens = actual
        prompt_tokens = min(actual, prompt_len) - prompt_before
        self._scheduled[request_id] = ScheduledWork(
            tokens_used,
            prompt_tokens,
            prompt_before,
            prompt_len,
            length,
            seq.generated >= seq.max_output_tokens,
        )
        if prompt_tokens > 0 and self.worker_type is not WorkerType.DECODE:
            self._batch_count += 1
            self._batch_isl += prompt_before + prompt_tokens
            self._batch_prefix += prompt_before
        if from_waiting:
            self.state.transition_to_running(request_id)
            if req.cached_prefix_tokens is None:
                req.cached_prefix_tokens = cached
            self._cache_queries += length
            self._cache_hits += cached
        self._budget = budget - tokens_used
        return SCHEDULED, tokens_used, cached

    def _undo_scheduled(self, victim: str) -> None:
        work = self._scheduled.pop(victim, None)
        if work is None:
            return
        self._budget += work.total_tokens
        if work.prompt_tokens > 0 and self.worker_type is not WorkerType.DECODE:
            self._batch_count -= 1
            self._batch_isl -= work.prefix_tokens + work.prompt_tokens
            self._batch_prefix -= work.prefix_tokens

    def preempt(self) -> str | None:
        """Evict one running request back to the front of the queue (newest first by default)."""
        if not self.policy.allows_preemption:
            return None
        state = self.state
        order = reversed(state.running) if self.lifo else iter(state.running)
        requests = state.requests
        if self.kv.offload is None:
            victim = next((u for u in order if requests[u].status is RequestStatus.RUNNING), None)
        else:
            # A request waiting on an offload is not preempted: its blocks free up by themselves.
            victim = next(
                (
                    u
                    for u in order
                    if requests[u].status is RequestStatus.RUNNING
                    and not self.offload_wait_live(requests[u])
                ),
                None,
            )
        if victim is None:
            return None
        req = state.requests[victim]
        state.remove_running(victim)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        state.preemptions_total += 1
        moves = req.seq.reset_with_moves()
        state.prepend_waiting(victim)
        self.capacity_generation += 1
        ok = self.kv.apply_all(moves)
        assert ok, "preemption cleanup must be infallible"
        return victim

    def _fpm(self, wall_time_secs: float) -> FpmSnapshot:
        queued = self.queued
        return build_snapshot(
            self._scheduled.values(),
            queued.prefill.summary(),
            queued.decode.summary(),
            wall_time_secs,
        )

    def take_lifecycle_events(self) -> list[LifecycleEvent]:
        events = self._lifecycle
        self._lifecycle = []
        return events
