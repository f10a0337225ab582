"""What one pass accumulates while it runs; created per pass, read once, then dropped.

The scheduler and the token emitter write into it (nothing pass-scoped lives on a part), and
the engine turns it into the pass's `PassResult`.
"""

from __future__ import annotations

from engined.core.fpm import ScheduledWork
from engined.core.named_tuples import new_tuple
from engined.core.pass_trace import PassTrace, ScheduledTokens
from engined.core.perf_model import PerfModel, scale_ms
from engined.core.state import RequestState
from engined.core.types import (
    Admission,
    EndedRequest,
    LifecycleEvent,
    RequestOutput,
)


class PassContext:
    __slots__ = (
        "admissions",
        "batch_count",
        "batch_isl",
        "batch_prefix",
        "budget",
        "cache_hits",
        "cache_queries",
        "decode_forwards",
        "decoded_before",
        "decoded_ids",
        "decoded_tokens",
        "defer_prefills",
        "draft_slots",
        "ended",
        "fused",
        "fused_len",
        "input_budget",
        "kv_holding_only",
        "lifecycle",
        "long_prefill_cap",
        "now_ms",
        "output_tokens",
        "outputs",
        "preempted_any",
        "prefill_scheduled",
        "prefilled",
        "ready",
        "rejected",
        "scheduled",
        "shares",
        "spec_accepted_per_pos",
        "spec_accepted_tokens",
        "spec_draft_tokens",
        "spec_drafts",
        "victims",
    )

    def __init__(self, now_ms: float, budget: int, victims: list[str] | None = None) -> None:
        self.now_ms = now_ms
        # Tokens this pass may still schedule, and may give one request (0: no cap).
        self.budget = budget
        # vLLM's input budget (`max_num_batched_tokens`) where speculative decoding gives
        # every scheduled request `draft_slots` more input slots (its draft_model method);
        # read only when `draft_slots` is set (`room`).
        self.draft_slots = 0
        self.input_budget = 0
        self.long_prefill_cap = 0
        # vLLM's prefill cadence (`PrefillCadence`): whether the pass holds prefill back, and
        # whether it carried any (a running chunk or an admission with prompt to compute).
        self.defer_prefills = False
        self.prefilled = False
        # Whether the running walk scheduled a request mid-prefill (vLLM's
        # `prefill_scheduled`: no MTP padding of admissions then).
        self.prefill_scheduled = False
        # Paused (PAUSED_NEW, engined/core/pausing.py): admit only requests holding KV.
        self.kv_holding_only = False
        # What each scheduled request computes, in schedule order, for FPM and for undoing a
        # preemption; each names its request (`request_id`). The request itself is the
        # common case, a decode of one token, by its `scheduled_len` (building a
        # ScheduledWork per request per pass was a sixth of a decode pass's scheduling, and
        # an int of the length was boxed and freed per request per pass). A list, not a dict
        # by id: a request is scheduled at most once a pass, and only a preemption looks one
        # up, while every running request is appended every pass.
        self.scheduled: list[ScheduledWork | RequestState] = []
        # The prefill batch the timing model charges: chunks, their total length and prefix.
        self.batch_count = 0
        self.batch_isl = 0
        self.batch_prefix = 0
        # A preemption (or a running request waiting on an offload) stops admission.
        self.preempted_any = False
        # Prefix-cache lookups of this pass's admissions: tokens queried, tokens found.
        self.cache_queries = 0
        self.cache_hits = 0
        self.admissions: list[Admission] = []
        # Requests admission refused this pass; their outputs follow the emitted ones.
        self.rejected: list[str] = []
        self.outputs: list[RequestOutput] = []
        # The plain decode steps (`Decodes`): no output object, no list, per token; and for
        # each of `outputs`, how many of them came before it (`add_output`).
        self.decoded_ids: list[str] = []
        self.decoded_tokens: list[int] = []
        self.decoded_before: list[int] = []
        # vLLM semantics, synchronous and LIFO: the scheduler samples a plain decode step
        # where it schedules it (`PagedScheduler`), so a steady pass walks its running
        # requests once, not once to schedule, twice to emit. `fused` of those are in the
        # decode columns already, `fused_len` their lengths before the token (the decode
        # batch's modeled length). `ready` is every other request the pass leaves ready to
        # sample, in running order, each with how many fused steps came before it; None when
        # the scheduler does not fuse (the emitter then walks the running list).
        self.fused = 0
        self.fused_len = 0
        self.ready: list[tuple[RequestState, int]] | None = None
        self.ended: list[EndedRequest] = []
        self.lifecycle: list[LifecycleEvent] = []
        # MTP acceptance figures: visible output tokens, decode forwards.
        self.output_tokens = 0
        self.decode_forwards = 0
        # MTP, vLLM's `SpecDecodingStats`: drafts verified (one a request), their tokens,
        # the accepted ones, and per draft position those accepted there (`accepted`).
        self.spec_drafts = 0
        self.spec_draft_tokens = 0
        self.spec_accepted_tokens = 0
        self.spec_accepted_per_pos: list[int] = []
        # Recording (`PassTrace`): the preempter's victim list, and the shares read from it.
        self.victims = victims
        self.shares: list[ScheduledTokens] = []

    def accepted(self, drafts: int, accepted: int) -> None:
        """MTP: a request verified `drafts` drafts and accepted the first `accepted`."""
        self.spec_drafts += 1
        self.spec_draft_tokens += drafts
        self.spec_accepted_tokens += accepted
        per_pos = self.spec_accepted_per_pos
        if len(per_pos) < accepted:
            per_pos.extend([0] * (accepted - len(per_pos)))
        for position in range(accepted):
            per_pos[position] += 1

    def room(self) -> int:
        """The tokens the next request may take (vLLM's `request_token_budget`): the budget,
        and with draft slots what the input budget leaves after the request's own."""
        if self.draft_slots:
            return min(self.budget, self.input_budget - self.draft_slots)
        return self.budget

    def long_prefill_share(self, lacking: int) -> int:
        """What a request lacking `lacking` tokens may take under the pass's long-prefill cap
        (vLLM's `long_prefill_token_threshold`), before the budget."""
        cap = self.long_prefill_cap
        return cap if 0 < cap < lacking else lacking

    def add_work(
        self,
        request_id: str,
        new: int,
        prompt_before: int,
        prompt_tokens: int,
        prompt_len: int,
        seq_len: int,
        last: bool,
        prefill: bool,
    ) -> None:
        """A request computes `new` tokens in this pass, `prompt_tokens` of them prompt
        after `prompt_before`, in a `seq_len` sequence (`last`: it has its last token);
        `prefill`: those prompt tokens join the pass's prefill batch (False when a transfer
        brought them)."""
        work = (request_id, new, prompt_tokens, prompt_before, prompt_len, seq_len, last)
        self.scheduled.append(new_tuple(ScheduledWork, work))
        if prompt_tokens > 0 and prefill:
            self.add_prefill(prompt_before, prompt_tokens)

    def add_prefill(self, prefix_tokens: int, prompt_tokens: int) -> None:
        """A request prefills `prompt_tokens` after `prefix_tokens` in this pass's batch."""
        self.batch_count += 1
        self.batch_isl += prefix_tokens + prompt_tokens
        self.batch_prefix += prefix_tokens

    def prefill_ms(self, perf: PerfModel) -> float:
        """The modeled duration of the pass's prefill batch (0 without one), rounded to a
        Rust `Duration` as upstream's is."""
        n = self.batch_count
        if not n:
            return 0.0
        raw = perf.prefill_ms(n, self.batch_isl // n, self.batch_prefix // n)
        return scale_ms(raw, 0.0)

    def unschedule(self, request_id: str, counts_prefill: bool) -> None:
        """A request scheduled earlier in this pass was preempted: its share goes back to the
        budget and leaves the prefill batch (`counts_prefill`: its prompt tokens were in it)."""
        scheduled = self.scheduled
        at = next((k for k, w in enumerate(scheduled) if w.request_id == request_id), None)
        if at is None:
            return
        work = scheduled.pop(at)
        if isinstance(work, RequestState):
            self.budget += 1
            self.input_budget += 1 + self.draft_slots
            return
        self.budget += work.total_tokens
        self.input_budget += work.total_tokens + self.draft_slots
        if work.prompt_tokens > 0 and counts_prefill:
            self.batch_count -= 1
            self.batch_isl -= work.prefix_tokens + work.prompt_tokens
            self.batch_prefix -= work.prefix_tokens

    def add_output(self, output: RequestOutput) -> None:
        """Every output but a plain decode step goes here, so emission order is kept."""
        self.outputs.append(output)
        self.decoded_before.append(len(self.decoded_ids))

    def read_shares(self, requests: dict[str, RequestState]) -> None:
        """When recording, each scheduled request's share, read before emission changes the
        requests: a decode by its `scheduled_len`, other work by its new computed count."""
        if self.victims is None:
            return
        shares = self.shares
        for work in self.scheduled:
            request_id = work.request_id
            if isinstance(work, RequestState):
                shares.append(ScheduledTokens(request_id, work.scheduled_len - 1, 1))
            else:
                new = work.total_tokens
                computed = requests[request_id].num_computed_tokens - new
                shares.append(ScheduledTokens(request_id, computed, new))

    def trace(self) -> PassTrace | None:
        """The pass's `PassTrace` when recording (taking the victims), else None."""
        victims = self.victims
        if victims is None:
            return None
        taken = victims[:]
        victims.clear()
        return PassTrace(self.shares, taken)
