"""MTP under vLLM 0.33's semantics: the verification half of a speculative decode step.

vLLM's scheduler treats draft tokens as tokens a request lacks (`num_tokens_with_spec`): a
running request schedules its known tokens and the drafts proposed after its last step, as
far as the budget and `max_model_len` allow, with `num_speculative_tokens` lookahead slots
past them; the drafts not reached are dropped. A request admitted with one token to compute
while others decode is padded to the uniform decode shape with placeholder drafts, which are
never accepted (engined/core/paged/scheduler.py and admission.py do the scheduling).

Here, at the end of the pass (vLLM's `update_from_output` and `update_draft_token_ids`):
each ready request samples its token and accepts a run of its verified drafts (drawn from
the MTP acceptance rates, `SpeculativeSampler`), so it emits 1 + accepted tokens, cut at a
stop as vLLM cuts them; the rejected drafts come off `num_computed_tokens`, and the blocks
its computed tokens fill are cached (vLLM caches them here, not at the next allocation, as
a block's lookahead hash needs the token after it: engined/core/paged/kv_cache_manager.py).
Every request still running then has `num_speculative_tokens` new drafts for its next step.
"""

from __future__ import annotations

from collections.abc import Callable

from engined.core.finish import Finisher
from engined.core.paged.kv_cache_manager import PagedKvManager
from engined.core.pass_context import PassContext
from engined.core.sequence import BlockMove
from engined.core.speculative import SpeculativeSampler
from engined.core.state import RequestState
from engined.core.types import RequestOutput, RequestStatus

_RUNNING = RequestStatus.RUNNING

# The decode time of `batch` requests of `total_len` tokens.
DecodeMs = Callable[[int, int], float]


class SpecDecoder:
    __slots__ = ("_decode_ms", "_finisher", "_kv", "_num_spec", "_sampler")

    def __init__(
        self,
        sampler: SpeculativeSampler,
        *,
        num_spec: int,
        kv: PagedKvManager,
        finisher: Finisher,
        decode_ms: DecodeMs,
    ) -> None:
        self._sampler = sampler
        self._kv = kv
        self._num_spec = num_spec
        self._finisher = finisher
        self._decode_ms = decode_ms

    @property
    def num_spec(self) -> int:
        """Draft tokens proposed after each step (vLLM's `num_speculative_tokens`)."""
        return self._num_spec

    def emit(self, ctx: PassContext, ready: list[RequestState]) -> float:
        """Verify and sample every ready request's step; returns the decode duration (ms)."""
        decode_ms = self._decode_ms(len(ready), sum(len(req.seq.tokens) for req in ready))
        num_spec = self._num_spec
        emitted = 0
        for req in ready:
            tokens, cleanup = self.verify(ctx, req, req.scheduled_drafts, req.padded_drafts)
            req.scheduled_drafts = 0
            req.padded_drafts = False
            emitted += len(tokens)
            if cleanup is not None:
                self._finisher.finish(ctx, req, tokens, cleanup)
                continue
            req.spec_tokens = num_spec
            ctx.add_output(RequestOutput(req.request_id, tokens, None, req.take_cached_tokens()))
        ctx.output_tokens += emitted
        ctx.decode_forwards += len(ready)
        return decode_ms

    def verify(
        self,
        ctx: PassContext,
        req: RequestState,
        drafts: int,
        padded: bool,
        *,
        stale: bool = False,
    ) -> tuple[list[int], list[BlockMove] | None]:
        """vLLM's `update_from_output` of one request's step that verified `drafts` drafts
        (`padded`: placeholders, never accepted): the rejected ones rolled back (and their
        output placeholders, under async scheduling; not for `stale` output, which a
        preemption already reset), 1 + accepted tokens taken, cut at a stop (the computed
        tokens with them), the placeholders of every token returned resolved, and the full
        blocks cached. Returns the tokens, and the moves that free the request when it
        finished (None while it runs)."""
        seq = req.seq
        accepted = (
            self._sampler.sample_output_tokens(drafts + 1, req.acceptance) - 1
            if drafts and not padded
            else 0
        )
        if drafts:
            # vLLM counts what the model accepted, before a stop cuts the tokens.
            ctx.accepted(drafts, accepted)
            if not stale:
                if req.num_computed_tokens > 0:
                    req.num_computed_tokens -= drafts - accepted
                if req.num_output_placeholders > 0:
                    req.num_output_placeholders -= drafts - accepted
        placeholder = req.num_output_placeholders > 0
        running = req.status is _RUNNING
        tokens: list[int] = []
        cleanup = None
        for _ in range(1 + accepted):
            token, moves = seq.generate_token()
            tokens.append(token)
            if seq.finished():
                cleanup = moves
                if not stale:
                    req.num_computed_tokens -= 1 + accepted - len(tokens)
                break
        if not stale:
            if placeholder:
                req.num_output_placeholders -= 1 + accepted
            if running:
                self._kv.cache_computed(seq, req.num_computed_tokens - req.num_in_flight_tokens)
        return tokens, cleanup
