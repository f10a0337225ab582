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
from engined.core.speculative import SpeculativeSampler
from engined.core.state import RequestState
from engined.core.types import RequestOutput

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

    def emit(self, ctx: PassContext, ready: list[RequestState]) -> float:
        """Verify and sample every ready request's step; returns the decode duration (ms)."""
        decode_ms = self._decode_ms(len(ready), sum(len(req.seq.tokens) for req in ready))
        sample = self._sampler.sample_output_tokens
        num_spec = self._num_spec
        cache = self._kv.cache_computed
        emitted = 0
        for req in ready:
            seq = req.seq
            drafts = req.scheduled_drafts
            accepted = sample(drafts + 1) - 1 if drafts and not req.padded_drafts else 0
            if drafts:
                # vLLM counts what the model accepted, before a stop cuts the tokens.
                ctx.spec_drafts += 1
                ctx.spec_draft_tokens += drafts
                ctx.spec_accepted_tokens += accepted
            req.num_computed_tokens -= drafts - accepted
            req.scheduled_drafts = 0
            req.padded_drafts = False
            tokens: list[int] = []
            cleanup = None
            for _ in range(1 + accepted):
                token, moves = seq.generate_token()
                tokens.append(token)
                if seq.finished():
                    cleanup = moves
                    break
            emitted += len(tokens)
            cache(seq, req.num_computed_tokens)
            if cleanup is not None:
                self._finisher.finish(ctx, req, tokens, cleanup)
                continue
            req.spec_tokens = num_spec
            ctx.add_output(RequestOutput(req.request_id, tokens, None, req.take_cached_tokens()))
        ctx.output_tokens += emitted
        ctx.decode_forwards += len(ready)
        return decode_ms
