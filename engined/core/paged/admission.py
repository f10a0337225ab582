"""Step 2 of a pass under vLLM 0.33's semantics: waiting requests into running.

In queue order (FCFS, or by (priority, arrival)), while the budget and the admission limit
(`max_num_seqs`, or `max_num_active_seqs`) allow, each request looks up its prefix hit and
is admitted if slots for its chunk can be allocated, see engined/core/paged/scheduler.py
for the rest of the rule. `record` is a scheduled request's share of the pass, for the
running walk too.

With `enable_lora`, as vLLM's scheduler: the adapters of the running requests (scheduled in
this pass or not) and of those admitted so far may number `max_loras`; a request for another
adapter is skipped, and the scan goes on past it (a base-model request, or one for an adapter
in the set, may still be admitted). The skipped requests go back to the front of the queue
in their order when the scan ends, and count as deferred until admitted
(`SchedulerState.deferred`).
"""

from __future__ import annotations

from engined.core.args import EngineArgs
from engined.core.finish import Finisher
from engined.core.handoff_book import PendingDestinations
from engined.core.paged.hit_reports import store_hit_again
from engined.core.paged.kv_cache_manager import PagedKvManager
from engined.core.paged.pass_limits import PassLimits
from engined.core.pass_context import PassContext
from engined.core.policy import AdmissionPolicy
from engined.core.state import RequestState, SchedulerState
from engined.core.types import Admission, RequestStatus


class PagedAdmission:
    __slots__ = (
        "_block_size",
        "_chunked",
        "_counts_prefill",
        "_finisher",
        "_full_isl",
        "_kv",
        "_limits",
        "_max_loras",
        "_max_model_len",
        "_max_num_seqs",
        "_num_spec",
        "_pending",
        "_policy",
        "_state",
    )

    def __init__(
        self,
        args: EngineArgs,
        *,
        max_num_seqs: int,
        limits: PassLimits,
        state: SchedulerState,
        kv: PagedKvManager,
        policy: AdmissionPolicy,
        pending: PendingDestinations,
        finisher: Finisher,
    ) -> None:
        self._block_size = args.block_size
        self._chunked = args.enable_chunked_prefill
        self._full_isl = args.scheduler_reserve_full_isl
        self._max_num_seqs = max_num_seqs
        self._max_model_len = policy.max_model_len
        # MTP's draft tokens per step (engined/core/paged/spec_decode.py); 0 without MTP.
        self._num_spec = args.aic_nextn or 0
        # 0: LoRA off (no request carries an adapter).
        self._max_loras = args.max_loras if args.enable_lora else 0
        self._counts_prefill = args.prompts_cost_prefill
        self._limits = limits
        self._state = state
        self._kv = kv
        self._policy = policy
        self._pending = pending
        self._finisher = finisher

    def admit(self, ctx: PassContext) -> None:
        """Step 2 of the pass (engined/core/paged/scheduler.py), after a running walk that
        preempted nothing."""
        if not self._max_loras:
            self._scan(ctx, None, [])
            return
        loras: set[int] = set()
        for req in self._state.running:
            lora = req.seq.lora
            if lora is not None:
                loras.add(lora.lora_int_id)
        skipped: list[str] = []
        self._scan(ctx, loras, skipped)
        if skipped:
            self._state.requeue_skipped(skipped)

    def _scan(self, ctx: PassContext, loras: set[int] | None, skipped: list[str]) -> None:
        """Admit in queue order; with LoRA on, `loras` are the adapters running, and the
        requests passed over for theirs join `skipped`, out of the queue."""
        max_loras = self._max_loras
        state = self._state
        requests = state.requests
        kv = self._kv
        bs = self._block_size
        policy = self._policy
        # While a P/D destination waits for KV, only activated ones (their prompt's KV
        # already here) are admitted, as on the mocker's pool; and only those while paused
        # (vLLM's PAUSED_NEW admits only requests holding KV).
        pending_head = bool(self._pending) or ctx.kv_holding_only
        spec = self._num_spec
        # Whether the running walk scheduled anything (MTP pads admissions then).
        ran = bool(ctx.scheduled)
        while ctx.room() > 0 and len(state.running_members) < self._max_num_seqs:
            request_id = state.next_waiting(pending_head)
            if request_id is None:
                return
            req = requests[request_id]
            seq = req.seq
            lora = seq.lora
            if (
                loras is not None
                and lora is not None
                and len(loras) == max_loras
                and lora.lora_int_id not in loras
            ):
                state.skip_waiting(request_id)
                skipped.append(request_id)
                continue
            if req.prompt_is_prebuilt():
                computed = req.num_computed_tokens
                num_new = len(seq.tokens) - computed
                padded = self._pads(ctx, ran, computed, num_new) if spec else False
                if padded is None:
                    return
                if padded:
                    num_new = 1 + spec
                if not kv.allocate_slots(seq, computed, num_new, now_ms=ctx.now_ms, lookahead=spec):
                    return
                if spec:
                    self._set_drafts(req, padded)
                state.transition_to_running(request_id)
                if loras is not None and lora is not None:
                    loras.add(lora.lora_int_id)
                ctx.admissions.append(Admission(request_id, computed))
                record(ctx, req, computed, num_new, prefill=False)
                continue
            if pending_head:
                return
            if req.status is RequestStatus.WAITING and policy.rejects(
                seq, seq.current_known_blocks()
            ):
                ctx.rejected.append(request_id)
                self._finisher.drop(request_id)
                continue
            hit = kv.get_computed_blocks(seq)
            if hit and req.report_hits:
                store_hit_again(kv, seq, hit)
            cached = len(hit) * bs
            if ctx.defer_prefills and cached < len(seq.tokens) - 1:
                return
            num_new = len(seq.tokens) - cached
            padded = self._pads(ctx, ran, cached, num_new) if spec else False
            if padded is None:
                return
            if padded:
                num_new = 1 + spec
            num_new = ctx.long_prefill_share(num_new)
            room = ctx.room()
            if not self._chunked and num_new > room:
                return
            num_new = min(num_new, room)
            watermark = self._limits.admission_watermark(len(state.running))
            if not kv.allocate_slots(
                seq,
                0,
                num_new,
                hit,
                full_sequence_must_fit=self._full_isl,
                now_ms=ctx.now_ms,
                watermark_blocks=watermark,
                lookahead=spec,
            ):
                return
            if spec:
                self._set_drafts(req, padded)
            state.transition_to_running(request_id)
            if loras is not None and lora is not None:
                loras.add(lora.lora_int_id)
            if req.cached_prefix_tokens is None:
                req.cached_prefix_tokens = cached
            ctx.admissions.append(Admission(request_id, cached))
            if cached < len(seq.tokens) - 1:
                ctx.prefilled = True
            if not req.num_preemptions:
                # vLLM counts a resumed request's lookup apart (`preempted_queries`).
                ctx.cache_queries += len(seq.tokens)
                ctx.cache_hits += cached
            record(ctx, req, cached, num_new, self._counts_prefill)

    def _pads(self, ctx: PassContext, ran: bool, computed: int, num_new: int) -> bool | None:
        """Whether an admission of `num_new` tokens after `computed` is padded to a decode
        step with MTP's placeholder drafts, as vLLM pads new decode requests to the uniform
        decode shape (a one-token prompt, or one whose prefix hit leaves one token, when
        something else decodes); None: it cannot be, and admission stops (vLLM prefers
        not scheduling to scheduling unpadded)."""
        spec = self._num_spec
        if (
            num_new != 1
            or ctx.prefill_scheduled
            or not (ran or computed > 0)
            or computed + 1 + spec + 1 > self._max_model_len
        ):
            return False
        return True if 1 + spec <= ctx.room() else None

    def _set_drafts(self, req: RequestState, padded: bool) -> None:
        """An admitted request verifies no drafts, or, `padded`, the placeholders."""
        req.scheduled_drafts = self._num_spec if padded else 0
        req.padded_drafts = padded
        req.spec_tokens = 0


def record(ctx: PassContext, req: RequestState, computed: int, num_new: int, prefill: bool) -> None:
    """`req` computes `num_new` tokens after `computed` in this pass (`prefill` False: its
    prompt tokens cost no prefill time, a transfer brought them)."""
    seq = req.seq
    prompt_len = seq.num_input_tokens
    prompt_before = min(computed, prompt_len)
    prompt_tokens = min(computed + num_new, prompt_len) - prompt_before
    req.num_computed_tokens = computed + num_new
    req.is_prefill_chunk = computed + num_new < len(seq.tokens) + req.num_output_placeholders
    ready = ctx.ready
    if ready is not None and computed + num_new >= len(seq.tokens):
        ready.append((req, len(ctx.decoded_ids)))
    last = seq.generated >= seq.max_output_tokens
    ctx.add_work(
        req.request_id,
        num_new,
        prompt_before,
        prompt_tokens,
        prompt_len,
        len(seq.tokens),
        last,
        prefill,
    )
    ctx.budget -= num_new
    ctx.input_budget -= num_new + ctx.draft_slots
