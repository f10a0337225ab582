"""The scheduling half of a pass under vLLM 0.33's semantics (vLLM's `Scheduler.schedule()`).

1. Running requests in order, each taking what it lacks of its known tokens (and, with
   async scheduling, of the placeholders for tokens still being sampled; a request whose
   last token is among them is passed over), capped by the budget, by
   `long_prefill_token_threshold` (`PassLimits`; admissions too) and by
   `max_model_len - 1` past what it computed. Its slots are allocated now
   (`allocate_slots`); when they cannot be, the last running request is preempted (vLLM's
   FCFS; under `scheduling_policy = priority` the one of greatest (priority, arrival)),
   until the allocation succeeds or the request preempted itself, which ends the running
   step (under priority, the walk goes on with the next). A request with nothing to
   schedule is passed over.
2. Waiting requests in queue order (FCFS, or by (priority, arrival)), only when nothing was
   preempted, while the budget and `max_num_seqs` (or `max_num_active_seqs`) allow: each
   looks up its prefix hit and is admitted if slots for its chunk can be allocated and
   (`scheduler_reserve_full_isl`, vLLM's default) the free blocks could hold its whole known
   sequence, either leaving `watermark` of the pool free while requests run; otherwise
   admission stops. Without chunked prefill a prompt that does not fit the remaining budget
   stops admission too (engined/core/paged/admission.py).

With `prefill_schedule_interval` a pass may hold prefill back (`PrefillCadence`): it passes
over running requests mid-prefill and stops admission at a request with prompt to compute.

Synchronous, under FCFS with LIFO preemption, the walk of step 1 also samples each decode
step that ends nothing and reports nothing, as the emitter would (nothing the walk has passed
can be preempted later in the pass, the victim being the last running request): a steady
pass then walks its running requests once. The emitter gets the other ready requests, in
running order (`PassContext.ready`).

A fresh request that could never fit the pool is rejected (vLLM would hold it at the head of
its queue forever). Everything the pass accumulates goes into its `PassContext`.
"""

from __future__ import annotations

from array import array
from typing import Any

from engined.core.args import EngineArgs, PreemptionMode, SchedulingPolicy
from engined.core.paged.admission import PagedAdmission, record
from engined.core.paged.kv_cache_manager import PagedKvManager
from engined.core.paged.pass_limits import PassLimits, PrefillCadence
from engined.core.pass_context import PassContext
from engined.core.perf_model import PerfModel
from engined.core.policy import AdmissionPolicy
from engined.core.preemption import Preempter
from engined.core.state import RequestState, SchedulerState
from engined.core.vocab import Vocabulary


class PagedScheduler:
    __slots__ = (
        "_admission",
        "_by_priority",
        "_cadence",
        "_counts_prefill",
        "_draft_slots",
        "_fuse",
        "_input_budget",
        "_kv",
        "_limits",
        "_max_model_len",
        "_num_spec",
        "_perf",
        "_preempter",
        "_state",
        "_vocab",
        "block_size",
        "max_batched_tokens",
    )

    def __init__(
        self,
        args: EngineArgs,
        *,
        max_batched_tokens: int,
        state: SchedulerState,
        kv: PagedKvManager,
        policy: AdmissionPolicy,
        admission: PagedAdmission,
        limits: PassLimits,
        preempter: Preempter,
        perf: PerfModel,
        vocab: Vocabulary,
        fast_paths: bool = True,
    ) -> None:
        self.block_size = args.block_size
        self.max_batched_tokens = max_batched_tokens
        self._max_model_len = policy.max_model_len
        self._limits = limits
        interval = args.prefill_schedule_interval
        self._cadence = PrefillCadence(interval) if interval > 1 else None
        self._counts_prefill = args.prompts_cost_prefill
        self._by_priority = args.scheduling_policy is SchedulingPolicy.PRIORITY
        self._state = state
        self._kv = kv
        self._preempter = preempter
        self._perf = perf
        self._vocab = vocab
        self._admission = admission
        # MTP (vLLM's `num_speculative_tokens`): draft tokens verified with each decode step
        # and as many lookahead slots (engined/core/paged/spec_decode.py); 0 without MTP.
        self._num_spec = args.aic_nextn or 0
        # vLLM's `max_num_new_slots_for_drafting`: input slots each scheduled request takes
        # beyond its tokens, from `max_num_batched_tokens` (its draft_model method: 1).
        self._draft_slots = args.drafting_slots if self._num_spec else 0
        self._input_budget = args.max_num_batched_tokens or max_batched_tokens
        # Sampling plain decode steps where they are scheduled (`PassContext.ready`) needs
        # every scheduled request to stay scheduled: so not under async scheduling (the
        # batch samples later), the priority policy or FIFO preemption (either may preempt
        # a request the walk has passed).
        self._fuse = (
            fast_paths
            and not self._num_spec
            and not args.async_scheduling
            and not self._by_priority
            and args.preemption_mode is PreemptionMode.LIFO
        )

    def schedule(self, ctx: PassContext) -> None:
        if self._fuse:
            ctx.ready = []
        state = self._state
        ctx.long_prefill_cap = self._limits.long_prefill_cap(len(state.running), len(state.waiting))
        cadence = self._cadence
        if cadence is not None:
            ctx.defer_prefills = cadence.holds(state.running)
        self._schedule_running(ctx)
        if not ctx.preempted_any:
            self._admission.admit(ctx)
            if cadence is not None and not ctx.defer_prefills:
                cadence.admitted(len(state.waiting) - len(state.deferred))
        if cadence is not None:
            cadence.passed(bool(ctx.scheduled), ctx.prefilled)

    def prefill_ms(self, ctx: PassContext) -> float:
        """The modeled duration of the pass's prefill batch (0 without one)."""
        return ctx.prefill_ms(self._perf)

    def _schedule_running(self, ctx: PassContext) -> None:
        if self._num_spec:
            self._schedule_running_spec(ctx)
            return
        running = self._state.running
        kv = self._kv
        max_model_len = self._max_model_len
        bs = self.block_size
        # NOTE: the lists, not their bound appends: compiled, `xs.append(x)` is a C call and
        # a bound method a Python call.
        scheduled = ctx.scheduled
        ready = ctx.ready
        draw: Any = self._vocab.draw
        # NOTE: the array's method itself, and the drawn token typed Any (emission.py).
        append_token: Any = array.append
        decoded_ids = ctx.decoded_ids
        decoded_tokens = ctx.decoded_tokens
        fused_len = 0
        budget = ctx.budget
        # The offset of a token that fills its block: the next one opens a new block.
        fills = bs - 1
        # A held pass (`PrefillCadence`) passes over requests mid-prefill.
        defer = ctx.defer_prefills
        # Only the general step below changes the running list (a preemption).
        n = len(running)
        i = 0
        while i < n and budget > 0:
            req = running[i]
            seq = req.seq
            computed = req.num_computed_tokens
            tokens = seq.tokens
            length = len(tokens)
            if length < req.steady_until and length - computed == 1:
                # Inside a steady stretch (set below, where the checks were made): a decode
                # step in a held block that fills no block, and a sampling that ends nothing.
                # A running request's slots never reach past its tokens, and the last step
                # gave it a slot for each: this one takes the next.
                seq.num_allocated_tokens = length
                req.num_computed_tokens = length
                req.scheduled_len = length
                request_id = req.request_id
                scheduled.append(req)
                budget -= 1
                i += 1
                bits: Any = seq.token_bits
                drawn: Any = bits(32) if draw is None else draw(bits)
                append_token(tokens, drawn)
                seq.generated += 1
                decoded_ids.append(request_id)
                decoded_tokens.append(drawn)
                fused_len += length
                continue
            # How far the tokens reach into their last block (0: they end on a boundary).
            offset = length % bs
            if (
                length - computed == 1
                and computed >= seq.num_input_tokens
                and not (defer and req.is_prefill_chunk)
                and (
                    # The slot is in a held block (`(length - 1) // bs` at most
                    # `(allocated - 1) // bs`, without dividing).
                    (offset and seq.num_allocated_tokens > length - offset)
                    or (
                        ready is not None
                        and computed + 1 + (seq.generated < seq.max_output_tokens) <= max_model_len
                        and kv.append_slot(seq, length, ctx.now_ms)
                    )
                )
            ):
                # A decode step whose slot is in a held block and that fills no block:
                # `allocate_slots` would allocate and cache nothing. Or, when fused, one
                # that opens or fills a block and gets it without preempting: the general
                # path's `grow` step, without its generality. The request stands for its
                # ScheduledWork (one token), as on the mocker's decode path.
                if length > seq.num_allocated_tokens:
                    seq.num_allocated_tokens = length
                if req.is_prefill_chunk:
                    # The last token a resumed request recomputes: its prefill's end.
                    req.is_prefill_chunk = False
                    ctx.prefilled = True
                req.num_computed_tokens = length
                req.scheduled_len = length
                request_id = req.request_id
                scheduled.append(req)
                budget -= 1
                i += 1
                if ready is None:
                    continue
                if (
                    seq.generated + 1 < seq.max_output_tokens
                    and seq.plain
                    and req.cached_tokens_reported
                ):
                    # Its sampling, fused: the emitter's plain decode step (a token that
                    # ends nothing, with nothing to report), the same draw and effects. No
                    # later step of this pass can take it back: only the last running
                    # request is ever preempted (`ctx.ready`).
                    bits = seq.token_bits
                    drawn = bits(32) if draw is None else draw(bits)
                    if offset != fills:
                        append_token(tokens, drawn)
                        seq.generated += 1
                        if offset:
                            # The steady stretch: while the length stays short of the last
                            # slot of this block and of the last token, the next steps pass
                            # every check above (a preemption ends it: `Preempter`).
                            req.steady_until = min(
                                length - offset + fills,
                                length + seq.max_output_tokens - seq.generated,
                            )
                    else:
                        seq.push_paged(drawn)
                    decoded_ids.append(request_id)
                    decoded_tokens.append(drawn)
                    fused_len += length
                else:
                    ready.append((req, len(decoded_ids)))
                continue
            if defer and req.is_prefill_chunk:
                i += 1
                continue
            ctx.budget = budget
            i = self._schedule_step(ctx, req, i)
            budget = ctx.budget
            if i < 0:
                break
            n = len(running)
        ctx.budget = budget
        ctx.fused = len(decoded_ids)
        ctx.fused_len = fused_len

    def _schedule_running_spec(self, ctx: PassContext) -> None:
        """The running walk with MTP: every request by the general rule (a decode step
        schedules its drafts too, so the one-token fast paths do not apply)."""
        running = self._state.running
        if self._draft_slots:
            ctx.draft_slots = self._draft_slots
            ctx.input_budget = self._input_budget
        i = 0
        while i < len(running) and ctx.room() > 0:
            req = running[i]
            if ctx.defer_prefills and req.is_prefill_chunk:
                i += 1
                continue
            i = self._schedule_step(ctx, req, i)
            if i < 0:
                return

    def _schedule_step(self, ctx: PassContext, req: RequestState, i: int) -> int:
        """Schedule running request `req`, at `i`, by vLLM's general rule (allocating, and
        preempting for it); returns where the walk goes on, or -1 where it ends."""
        running = self._state.running
        kv = self._kv
        seq = req.seq
        computed = req.num_computed_tokens
        length = len(seq.tokens)
        # Async scheduling: tokens still being sampled are computed as placeholders, and
        # a request whose last token is among them has nothing left to schedule.
        placeholders = req.num_output_placeholders
        if (
            placeholders
            and computed + 2 - placeholders >= seq.num_input_tokens + seq.max_output_tokens
        ):
            return i + 1
        # Room for the token the step samples (none for a prefill-only request).
        cap = self._max_model_len - (seq.generated < seq.max_output_tokens) - computed
        lacking = length + req.spec_tokens + placeholders - computed
        num_new = min(ctx.long_prefill_share(lacking), ctx.room(), cap)
        if num_new <= 0:
            return i + 1
        preempted = False
        # A plain decode step that opens or fills a block takes `append_slot`, the same
        # allocation and caching without `allocate_slots`' generality.
        spec = self._num_spec
        grow = num_new == 1 and not placeholders and not spec and computed >= seq.num_input_tokens
        while not (
            kv.append_slot(seq, computed + 1, ctx.now_ms)
            if grow
            else kv.allocate_slots(seq, computed, num_new, now_ms=ctx.now_ms, lookahead=spec)
        ):
            victim = self._preempter.preempt()
            if victim is None:
                return -1
            ctx.preempted_any = preempted = True
            ctx.unschedule(victim, self._counts_prefill)
            if victim == req.request_id:
                # Under priority the requests after it rank higher and may still fit; the
                # next one now stands at `i`.
                return i if self._by_priority else -1
        if preempted and self._by_priority:
            # The victim may have run before it: find the request's place again.
            i = running.index(req)
        if req.is_prefill_chunk:
            ctx.prefilled = ctx.prefill_scheduled = True
        if spec:
            # vLLM verifies the drafts the step reaches and drops the rest; new ones come
            # after the step (`SpecDecoder.propose`).
            reached = computed + num_new - length - placeholders
            req.scheduled_drafts = max(min(reached, req.spec_tokens), 0)
            req.padded_drafts = False
            req.spec_tokens = 0
        if grow:
            # One decode token: the request stands for its ScheduledWork, as above.
            req.is_prefill_chunk = computed + 1 < length
            req.num_computed_tokens = req.scheduled_len = computed + 1
            ctx.scheduled.append(req)
            ctx.budget -= 1
            ready = ctx.ready
            if ready is not None and computed + 1 >= length:
                ready.append((req, len(ctx.decoded_ids)))
        else:
            record(ctx, req, computed, num_new, self._counts_prefill)
        return i + 1
