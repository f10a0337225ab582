"""`--async-scheduling`: vLLM 0.33's `AsyncScheduler` as its `EngineCore` runs it.

With async scheduling vLLM's engine core keeps a batch queue of 2
(`EngineCore.step_with_batch_queue`): each call schedules batch N while batch N-1 is still
on the GPU, and then, once the queue is full, waits for batch N-1 and calls
`update_from_output` on it. One engined pass is one such call:

1. If the engine holds requests, or finished ones no schedule has flushed yet (vLLM's
   `has_requests()`: the batch that flushes them is empty, but holds a place in the queue),
   schedule a batch (`PagedScheduler.schedule`) and queue it.
   Every request it schedules that is not left mid-prefill will sample a token nobody knows
   yet: it gets an output placeholder, counted in its computed tokens, so the next schedule
   gives it one more token to compute (the placeholder's) and allocates its slot (and block,
   and preempts for it) when vLLM does. A request whose last token is already in flight is
   passed over. If the queue was empty and something ran or remains, the pass ends here:
   nothing is delivered, and the KV events stay in the log for the next pass, as vLLM
   publishes them from `update_from_output` only.
2. Otherwise the oldest batch is resolved: each request it sampled for draws its token
   (appended, hashed), loses a placeholder, caches the blocks its delivered tokens fill, and
   gets its output; a request reaching its length finishes and frees its blocks.

So a request's tokens arrive one pass later than under the synchronous scheduler, and the
first pass after an idle engine delivers nothing. A request preempted while a batch of
its was in flight keeps that batch's token (vLLM delivers stale output rather than
resample it) but not its placeholder; vLLM's rule that holds back such a request until its
stale output drains never fires with a queue of 2, since the batch drains in the same call
that preempted it. A cache reset's preemption (`reset_running_requests`, a pause's clear)
drops that token instead (vLLM's `drop_stale_output`): the request resumes at once, and the
position is sampled again.

Paused (engined/core/pausing.py), a pass schedules only if the scheduler has requests under
the pause state, and otherwise only resolves the batch in flight, as `step_with_batch_queue`
does; a pause completes once no batch is in flight either.

Time: a pass lasts as long as the batch it resolves took to run (its prefill and decode
modeled at its schedule); a schedule-only pass takes none. Its FPM describes the batch it
scheduled. Outside vLLM semantics (mocker pool, offload tiers) async scheduling is refused
(`InvalidArgsError` from assembly).

With MTP, as vLLM's `AsyncScheduler`: a request that samples gets a placeholder for its
token and for each draft it verifies, and placeholder drafts for its next step, which is
scheduled with them before this one resolves; the resolution (paged/spec_decode.py
`verify`) rolls the rejected drafts back from both its computed tokens and its
placeholders.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple

from engined.core.emission import TokenEmitter
from engined.core.paged.kv_cache_manager import PagedKvManager
from engined.core.paged.scheduler import PagedScheduler
from engined.core.pass_context import PassContext
from engined.core.pausing import PauseControl
from engined.core.state import RequestState, SchedulerState
from engined.core.types import RequestOutput, RequestStatus

_RUNNING = RequestStatus.RUNNING


class Batch(NamedTuple):
    """A scheduled batch in flight: per request, the tokens it computes, whether it
    samples, and with MTP the drafts it verifies and whether they are placeholders
    (`RequestState.scheduled_drafts`, `padded_drafts`, which the next schedule overwrites);
    and its modeled duration."""

    requests: list[RequestState]
    num_tokens: list[int]
    samples: list[bool]
    drafts: list[int]
    padded: list[bool]
    duration_ms: float


class AsyncBatches:
    """EngineCore's batch queue (2 deep) over the paged scheduler."""

    __slots__ = ("_emitter", "_kv", "_num_spec", "_pausing", "_queue", "_scheduler", "_state")

    def __init__(
        self,
        *,
        state: SchedulerState,
        scheduler: PagedScheduler,
        kv: PagedKvManager,
        emitter: TokenEmitter,
        queue: deque[Batch],
        pausing: PauseControl | None = None,
    ) -> None:
        """`queue` starts empty (the pause control sees it too); `pausing` says whether the
        scheduler has requests while a pause is engaged."""
        self._state = state
        self._scheduler = scheduler
        self._kv = kv
        self._emitter = emitter
        # MTP's drafts per step (0: none), as the emitter verifies them.
        spec = emitter.spec_decoder
        self._num_spec = 0 if spec is None else spec.num_spec
        self._queue = queue
        self._pausing = pausing

    def step(self, ctx: PassContext) -> tuple[float, bool]:
        """One `step_with_batch_queue`: the modeled duration (ms) of the batch it resolved,
        and whether it resolved one (False: its KV events wait for the next pass)."""
        state = self._state
        queue = self._queue
        pausing = self._pausing
        # vLLM's `has_requests()` also counts finished ids no `schedule()` has taken yet:
        # the step after a finish schedules an empty batch to flush them, and that batch
        # holds a place in the queue (so the next step's KV events go out with it).
        finished = pausing is not None and pausing.finished_pending
        if pausing is not None and not pausing.engaged:
            pausing = None
        if (state.requests or finished) if pausing is None else pausing.has_requests():
            self._scheduler.schedule(ctx)
            ctx.read_shares(state.requests)
            batch = self._placeholders(ctx)
            queue.appendleft(batch)
            if self._pausing is not None:
                self._pausing.finished_pending = False  # `schedule()` took its finished ids
            more = bool(state.requests) if pausing is None else pausing.has_requests()
            if len(queue) < 2 and (batch.requests or more):
                return 0.0, False
        elif not queue:
            return 0.0, True
        batch = queue.pop()
        self._resolve(ctx, batch)
        return batch.duration_ms, True

    def _placeholders(self, ctx: PassContext) -> Batch:
        """vLLM's `_update_after_schedule`: the batch's tokens are in flight, and each
        request it does not leave mid-prefill gets a placeholder for its sampled token."""
        requests = self._state.requests
        batch: list[RequestState] = []
        counts: list[int] = []
        samples: list[bool] = []
        drafts: list[int] = []
        padded: list[bool] = []
        samplers = total_len = 0
        # MTP: a request that samples verifies its scheduled drafts, each a placeholder
        # too, and gets placeholder drafts for its next step (the worker drafts them).
        spec = self._num_spec
        for work in ctx.scheduled:
            req = requests[work.request_id]
            num = 1 if isinstance(work, RequestState) else work.total_tokens
            req.num_in_flight_tokens += num
            length = len(req.seq.tokens)
            sample = req.num_computed_tokens >= length + req.num_output_placeholders
            verified = req.scheduled_drafts if spec and sample else 0
            if sample:
                req.num_output_placeholders += 1 + verified
                if spec:
                    req.spec_tokens = spec
                samplers += 1
                total_len += length
            batch.append(req)
            counts.append(num)
            samples.append(sample)
            drafts.append(verified)
            padded.append(req.padded_drafts)
        duration = self._scheduler.prefill_ms(ctx)
        if samplers:
            duration += self._emitter.modeled_decode_ms(samplers, total_len)
        return Batch(batch, counts, samples, drafts, padded, duration)

    def _resolve(self, ctx: PassContext, batch: Batch) -> None:
        """vLLM's `update_from_output` for `batch`, its model output fabricated: one drawn
        token for every request it sampled for (still here: a cancelled one is skipped)."""
        requests = self._state.requests
        kv = self._kv
        emitter = self._emitter
        spec = emitter.spec_decoder
        emitted = 0
        for req, num, sample, drafts, padded in zip(
            batch.requests, batch.num_tokens, batch.samples, batch.drafts, batch.padded, strict=True
        ):
            request_id = req.request_id
            if requests.get(request_id) is not req:
                continue
            req.num_in_flight_tokens -= num
            stale = req.num_stale_output_tokens > 0
            if stale:
                req.num_stale_output_tokens -= num
                if req.drop_stale_output:
                    continue  # dropped: a cache reset resumed it at once
            if not sample:
                continue
            seq = req.seq
            if seq.generated >= seq.max_output_tokens:
                emitter.finish(ctx, req, [], seq.free_moves())
                continue
            if spec is not None:
                tokens, cleanup = spec.verify(ctx, req, drafts, padded, stale=stale)
                emitted += len(tokens)
                if cleanup is not None:
                    emitter.finish(ctx, req, tokens, cleanup)
                else:
                    ctx.add_output(
                        RequestOutput(request_id, tokens, None, req.take_cached_tokens())
                    )
                continue
            placeholder = req.num_output_placeholders > 0
            was_running = req.status is _RUNNING
            token, moves = seq.generate_token()
            emitted += 1
            if not stale and placeholder:
                req.num_output_placeholders -= 1
                if was_running:
                    kv.cache_computed(seq, req.num_computed_tokens - req.num_in_flight_tokens)
            if seq.finished():
                emitter.finish(ctx, req, [token], moves)
                continue
            cached = req.take_cached_tokens()
            if cached is None:
                ctx.decoded_ids.append(request_id)
                ctx.decoded_tokens.append(token)
            else:
                ctx.add_output(RequestOutput(request_id, [token], None, cached))
        ctx.output_tokens += emitted
        ctx.decode_forwards += emitted
