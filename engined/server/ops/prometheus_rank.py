"""The tallies of one rank behind `/metrics`, fed once per pass and once per command.

Cost is the design constraint: a daemon at speedup 0 emits ~300k tokens/s, so nothing here
runs per token in Python (engined.server.ops.prometheus_metrics says how each family is kept).
Per-request work happens when a request joins or leaves the emitting cohort (first token, pause,
resume, finish), never per decode step: the cohort of the latest emitting pass is a set, each pass's
emitters another, and C-level set operations find who joined and who paused.

A request's generated tokens are counted the same way: outside MTP each emitting pass gives
a request exactly one token, so the passes it spent in the cohort (an epoch counter, read
when it joins and when it leaves) are its tokens; an output with more than one token (an MTP
burst) adds the rest, found in the passes whose token total exceeds their emitters.

Like vLLM's `IterationStats` / `FinishedRequestStats` (vllm/v1/metrics/stats.py), per
request: queue time is arrival to first scheduling, prefill the first scheduling to the
first token, decode the first token to the last, inference the first scheduling to the last
token, time per output token the decode time over the tokens after the first; all recorded
when the request ends, with what a request never reached counted as 0 s (vLLM would subtract
an unset timestamp). A prompt's tokens are split by source when its first token comes:
local cache hits are the `cached_tokens` of its first output, a P/D destination's prompt KV
arrived by transfer (`DestinationReserved`: what its prefix cache lacked), the rest computed.
"""

from __future__ import annotations

from collections.abc import Callable

from engined.core.command_report import CommandReport
from engined.core.pass_report import PassReport
from engined.core.types import (
    ActivateDestination,
    Applied,
    CancelDestination,
    Command,
    DestinationAccepted,
    DestinationReserved,
    EngineMetrics,
    LifecycleEvent,
    ReserveDestination,
    Submit,
    SubmitHandoffPrefill,
    Submitted,
)
from engined.server.ops.prometheus_families import (
    ITERATION_TOKENS_BUCKETS,
    ITL_BUCKETS,
    KV_CACHE_RESIDENCY_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    REQUEST_NUM_PREEMPTIONS_BUCKETS,
    REQUEST_PARAMS_N_BUCKETS,
    TTFT_BUCKETS,
    LatencyHistogram,
    request_tokens_buckets,
)
from engined.server.ops.prometheus_lora import LoraRequestsInfo

# The core's reasons `request_success_total` counts as such; every other end is vLLM's abort.
_SUCCESS_LABELS: dict[str, str] = {"length": "length", "stop": "stop"}


class _Request:
    """What the per-request figures need of one live request; times are core milliseconds."""

    __slots__ = (
        "admissions",
        "admitted_ms",
        "arrival_ms",
        "cached",
        "external",
        "first_ms",
        "handoff",
        "joined",
        "last_ms",
        "max_tokens",
        "prompt_len",
        "tokens",
    )

    def __init__(self, arrival_ms: float, prompt_len: int, max_tokens: int) -> None:
        self.arrival_ms = arrival_ms
        self.prompt_len = prompt_len
        self.max_tokens = max_tokens
        self.admitted_ms: float | None = None
        self.admissions = 0
        self.first_ms: float | None = None
        # End of the pass of its latest token; only kept up to date once the request leaves
        # the emitting cohort (while in it, its latest token is at the cohort's end).
        self.last_ms = 0.0
        # The epoch (emitting pass) it last joined the cohort in, and its tokens before that.
        self.joined = 0
        self.tokens = 0
        # Prompt tokens found in the local prefix cache, and received by transfer; a P/D
        # destination's are known (and its handoff id) once its KV is reserved.
        self.cached = 0
        self.external = 0
        self.handoff: str | None = None


class RankMetrics:
    """Tallies of one rank, fed by its EngineLoop's observers, read by the collector.

    Args:
        rank: the data-parallel rank (the `engine` label).
        gauges: the rank's engine gauges now (`Engine.metrics`), read at scrape time.
        now_ms: the rank's clock (`EngineLoop.now_ms`), for requests a command ended.
        max_model_len: the longest prompt + output (the token histograms' last bucket).
        spec_tokens: MTP draft tokens per step on a rank that drafts (0: no spec decode).
        lora: the adapters in use, shared by the daemon's ranks (`enable_lora` only).
    """

    def __init__(
        self,
        rank: int,
        *,
        gauges: Callable[[], EngineMetrics],
        now_ms: Callable[[], float],
        max_model_len: int = 1 << 16,
        spec_tokens: int = 0,
        lora: LoraRequestsInfo | None = None,
    ) -> None:
        self.rank = rank
        self._lora = lora
        self.gauges = gauges
        self._now_ms = now_ms
        # Seconds per core millisecond: the core's times are modelled at any speedup.
        self._scale = 0.001
        self.requests: dict[str, _Request] = {}
        # Requests that emitted a token in the latest pass that emitted any, its end and its
        # number (the epoch); a request leaves it when it finishes (a reused id starts afresh).
        self._cohort: set[str] = set()
        self._cohort_end_ms = 0.0
        self._epoch = 0
        # A reserved destination's request, by handoff id, until activated or cancelled;
        # activated ones until they run (vLLM's KV fetch stage `completed_waiting`).
        self._destinations: dict[str, str] = {}
        self.fetched: set[str] = set()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.external_queries = 0
        self.external_hits = 0
        self.prompt_by_source = [0, 0, 0]  # PROMPT_SOURCES' order
        self.cached_by_source = [0, 0, 0, 0, 0]  # CACHE_HIT_SOURCES' order
        self.finished: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.spec_tokens = spec_tokens
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_pos = [0] * spec_tokens
        self.ttft = LatencyHistogram(TTFT_BUCKETS)
        self.itl = LatencyHistogram(ITL_BUCKETS)
        self.e2e = LatencyHistogram(REQUEST_LATENCY_BUCKETS)
        self.queue = LatencyHistogram(REQUEST_LATENCY_BUCKETS)
        self.inference = LatencyHistogram(REQUEST_LATENCY_BUCKETS)
        self.prefill = LatencyHistogram(REQUEST_LATENCY_BUCKETS)
        self.decode = LatencyHistogram(REQUEST_LATENCY_BUCKETS)
        self.tpot = LatencyHistogram(ITL_BUCKETS)
        tokens = request_tokens_buckets(max_model_len)
        self.request_prompt = LatencyHistogram(tokens)
        self.request_generation = LatencyHistogram(tokens)
        self.max_generation = LatencyHistogram(tokens)
        self.params_max_tokens = LatencyHistogram(tokens)
        self.prefill_computed = LatencyHistogram(tokens)
        self.params_n = LatencyHistogram(REQUEST_PARAMS_N_BUCKETS)
        self.preemptions = LatencyHistogram(REQUEST_NUM_PREEMPTIONS_BUCKETS)
        self.iteration = LatencyHistogram(ITERATION_TOKENS_BUCKETS)
        self.block_lifetime = LatencyHistogram(KV_CACHE_RESIDENCY_BUCKETS)
        self.block_idle = LatencyHistogram(KV_CACHE_RESIDENCY_BUCKETS)
        self.block_reuse_gap = LatencyHistogram(KV_CACHE_RESIDENCY_BUCKETS)

    # --- observers ----------------------------------------------------------------------

    def on_command(
        self, rank: int, arrival_ms: float, command: Command, report: CommandReport
    ) -> None:
        """A command was applied: a new request starts its clock; a dropped one ends."""
        result = report.result
        if isinstance(result, Submitted | DestinationAccepted) and isinstance(
            command, Submit | SubmitHandoffPrefill | ReserveDestination
        ):
            request = command.request
            self.requests[result.request_id] = _Request(
                arrival_ms, len(request.token_ids), request.max_tokens
            )
            if self._lora is not None and request.lora_request is not None:
                self._lora.submitted(self.rank, result.request_id, request.lora_request.lora_name)
        elif isinstance(command, ActivateDestination | CancelDestination):
            request_id = self._destinations.pop(command.handoff_id, None)
            activated = isinstance(result, Applied) and isinstance(command, ActivateDestination)
            if request_id is not None and activated:
                self.fetched.add(request_id)
        if report.ended:
            now_ms = self._now_ms()
            for ended in report.ended:
                self._finish(ended.request_id, now_ms, "abort")

    def on_lifecycle(self, events: list[LifecycleEvent], block_size: int) -> None:
        """A destination's KV was reserved: what its prefix cache had, the rest transferred
        (vLLM's KV connector hit: `external_prefix_cache_*`, the `p2p` cache hit source)."""
        for event in events:
            if not isinstance(event, DestinationReserved):
                continue
            record = self.requests.get(event.request_id)
            if record is None:
                continue
            self._destinations[event.handoff_id] = event.request_id
            record.handoff = event.handoff_id
            prompt_len = record.prompt_len
            blocks = -(-prompt_len // block_size) - event.transferable_prompt_tokens // block_size
            local = min(max(blocks, 0) * block_size, prompt_len)
            record.cached = local
            record.external = prompt_len - local
            self.external_queries += prompt_len - local
            self.external_hits += record.external
            self.cached_by_source[2] += record.external

    def on_pass(self, rank: int, now_ms: float, result: PassReport) -> None:
        """Fold one pass in: per-pass totals, and per-request work only where it is unavoidable."""
        tokens = result.accept_length_output_tokens
        self.generation_tokens += tokens
        self.prefix_cache_queries += result.prefix_cache_queries
        self.prefix_cache_hits += result.prefix_cache_hits
        self.cached_by_source[0] += result.prefix_cache_hits
        requests = self.requests
        fetched = self.fetched
        for admission in result.admissions:
            request_id = admission.request_id
            record = requests.get(request_id)
            if record is not None:
                record.admissions += 1
                if record.admitted_ms is None:
                    record.admitted_ms = now_ms  # vLLM's scheduled_ts: the step that scheduled it
            if fetched:
                fetched.discard(request_id)
        end_ms = result.end_ms
        outputs = result.outputs
        decoded = result.decodes.request_ids
        computed = 0
        cached: dict[str, int] = {}
        if outputs:
            cached = {o.request_id: o.cached_tokens for o in outputs if o.cached_tokens is not None}
        if outputs or decoded:
            # NOTE: a comprehension, not map(attrgetter): twice as fast on 3.11 for msgspec
            # Structs (specialised attribute loads). A token-less output (rejected, or
            # max_tokens 0) has no latency.
            emitters = {out.request_id for out in outputs if out.new_token_ids}
            emitters.update(decoded)
            if tokens > len(emitters):
                self._bursts(result)
            if self.spec_tokens:
                self._drafted(result)
            if emitters:
                computed = self._emitted(emitters, end_ms, cached)
        lora = self._lora
        if lora is not None:
            lora.outputs(self.rank, outputs)  # before the pass's ends, as vLLM's
        for ended in result.ended:
            request_id = ended.request_id
            label = _SUCCESS_LABELS.get(ended.reason, "abort")
            record = requests.get(request_id)
            if record is not None and record.first_ms is None and label != "abort":
                computed += self._prefilled(record, cached.get(request_id, 0))  # tokenless
            self._finish(request_id, end_ms, label)
        if outputs or decoded:
            self.iteration.add(computed + tokens)
        if lora is not None:
            lora.logged()
        if result.kv_block_evictions:
            scale = self._scale
            for eviction in result.kv_block_evictions:
                self.block_lifetime.add(eviction.lifetime_ms * scale)
                self.block_idle.add(eviction.idle_ms * scale)
                for gap in eviction.reuse_gaps_ms:
                    self.block_reuse_gap.add(gap * scale)

    # --- per pass -----------------------------------------------------------------------

    def _bursts(self, result: PassReport) -> None:
        """Outputs of more than one token: a request's tokens beyond the one its pass counts."""
        requests = self.requests
        for out in result.outputs:
            extra = len(out.new_token_ids) - 1
            if extra > 0:
                record = requests.get(out.request_id)
                if record is not None:
                    record.tokens += extra

    def _drafted(self, result: PassReport) -> None:
        """vLLM's `SpecDecodingStats`, as the pass counted them (vLLM semantics: each
        request that verified drafts; the mocker's bursts: each burst a draft of `nextn`)."""
        self.drafts += result.spec_drafts
        self.draft_tokens += result.spec_draft_tokens
        self.accepted += result.spec_accepted_tokens
        per_pos = self.accepted_per_pos
        for position, count in enumerate(result.spec_accepted_per_pos[: len(per_pos)]):
            per_pos[position] += count

    def _emitted(self, emitters: set[str], end_ms: float, cached: dict[str, int]) -> int:
        """Latencies of the requests that emitted tokens in a pass ending at `end_ms`; returns
        the prompt tokens computed for those whose first token this is."""
        scale = self._scale
        cohort = self._cohort
        previous_end = self._cohort_end_ms
        previous = self._epoch
        epoch = self._epoch = previous + 1
        joined = emitters - cohort if cohort else emitters
        continuing = len(emitters) - len(joined)
        if continuing:
            self.itl.add((end_ms - previous_end) * scale, continuing)
        requests = self.requests
        if continuing < len(cohort):
            # Someone paused (preempted, or out of budget): remember when it last emitted.
            for request_id in cohort - emitters:
                record = requests.get(request_id)
                if record is not None:
                    record.last_ms = previous_end
                    record.tokens += previous - record.joined + 1
        computed = 0
        for request_id in joined:
            record = requests.get(request_id)
            if record is None:
                continue
            record.joined = epoch
            if record.first_ms is None:
                record.first_ms = end_ms
                self.ttft.add((end_ms - record.arrival_ms) * scale)
                computed += self._prefilled(record, cached.get(request_id, 0))
            else:
                self.itl.add((end_ms - record.last_ms) * scale)
        self._cohort = emitters
        self._cohort_end_ms = end_ms
        return computed

    def _prefilled(self, record: _Request, cached: int) -> int:
        """The request's first output: its prompt by source; returns the tokens computed."""
        prompt_len = record.prompt_len
        if record.handoff is None:
            record.cached = min(cached, prompt_len)
        computed = prompt_len - record.cached - record.external
        self.prompt_tokens += prompt_len
        sources = self.prompt_by_source
        sources[0] += computed
        sources[1] += record.cached
        sources[2] += record.external
        return computed

    # --- per request --------------------------------------------------------------------

    def _finish(self, request_id: str, end_ms: float, reason: str) -> None:
        cohort = self._cohort
        in_cohort = request_id in cohort
        if in_cohort:
            cohort.discard(request_id)
        if self.fetched:
            self.fetched.discard(request_id)
        record = self.requests.pop(request_id, None)
        if record is None:
            return
        if record.handoff is not None:
            self._destinations.pop(record.handoff, None)
        if self._lora is not None:
            self._lora.finished(self.rank, request_id)
        if in_cohort:
            record.tokens += self._epoch - record.joined + 1
            last_ms = self._cohort_end_ms
        else:
            last_ms = record.last_ms
        self.finished[reason] += 1
        scale = self._scale
        self.e2e.add((end_ms - record.arrival_ms) * scale)
        admitted = record.admitted_ms
        first = record.first_ms
        if admitted is not None:
            self.queue.add((admitted - record.arrival_ms) * scale)
        tokens = record.tokens
        if first is None:
            prefill = decode = inference = 0.0
        else:
            decode = (last_ms - first) * scale
            prefill = (first - admitted) * scale if admitted is not None else 0.0
            inference = prefill + decode
        self.prefill.add(prefill)
        self.decode.add(decode)
        self.inference.add(inference)
        self.tpot.add(decode / (tokens - 1) if tokens > 1 else 0.0)
        self.request_prompt.add(record.prompt_len)
        self.request_generation.add(tokens)
        # The daemon sees each of a parent's n children as a request of its own (n = 1).
        self.max_generation.add(tokens)
        self.params_n.add(1)
        if record.max_tokens:
            self.params_max_tokens.add(record.max_tokens)
        self.preemptions.add(max(record.admissions - 1, 0))
        self.prefill_computed.add(record.prompt_len - record.cached - record.external)
