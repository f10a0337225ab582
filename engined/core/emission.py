"""Token emission at the end of a pass: one token per ready request, or an MTP burst.

A request is ready when its KV has caught up with its tokens. Sampling a token that opens a
new block allocates that block at once (mocker 1.3.0's eager allocation); when the pool is
full that preempts the newest running request, possibly the sampling one, and the same token
is retried, or kept for when the request runs again (`Sequence.popped`). A request with
nothing left to generate (max_tokens 0) completes here with a token-less last output, after its
prefill: upstream 1.3.0 never completed such requests, a defect fixed later, and we follow the
fix. A token that is one of the request's stop ids ends it too, as vLLM's `check_stop` does
(engined/core/stops.py): the token is emitted, the request freed in the same pass, and an MTP
burst ends at it, the rest of the burst dropped as vLLM drops the draft tokens after a stop.
On the mocker's pool MTP bursts reserve their blocks first and are emitted by
burst_emission.py; under vLLM semantics MTP is vLLM's speculative decoding, verified by
paged/spec_decode.py. A request's last output is the finisher's (finish.py).

Each request that emitted or finished gets exactly one output per pass (all of an MTP
burst's tokens in one `RequestOutput`), as vLLM's engine core reports a step; a plain decode
step (one token, unfinished, no cached tokens to report) goes to the pass's `Decodes`
columns instead, the per-token cost a steady pass no longer pays. Under vLLM semantics the
scheduler has sampled most of those already (engined/core/paged/scheduler.py): the emitter
then handles only the ready requests it lists, and places their entries among its steps.
"""

from __future__ import annotations

from array import array
from typing import Any

from engined.core.args import EngineArgs, WorkerType
from engined.core.block_moves import Deref
from engined.core.burst_emission import BurstEmitter
from engined.core.finish import Finisher
from engined.core.kv_cache import KvCache
from engined.core.kv_manager import KvManager
from engined.core.paged.kv_cache_manager import PagedKvManager
from engined.core.paged.spec_decode import SpecDecoder
from engined.core.pass_context import PassContext
from engined.core.perf_model import PerfModel, scale_ms
from engined.core.preemption import Preempter
from engined.core.sequence import BlockMove, Release
from engined.core.speculative import SpeculativeSampler
from engined.core.state import RequestState, SchedulerState
from engined.core.types import (
    FinishReason,
    RequestOutput,
    RequestStatus,
)
from engined.core.vocab import Vocabulary

_LENGTH = FinishReason.LENGTH
_STOP = FinishReason.STOP
# A request preempted earlier in the same emission is no longer RUNNING.
_RUNNING = RequestStatus.RUNNING


class TokenEmitter:
    __slots__ = (
        "_args",
        "_bursts",
        "_decode_ratio",
        "_fast_paths",
        "_finisher",
        "_kv",
        "_mocker_kv",
        "_mtp",
        "_perf",
        "_preempter",
        "_spec",
        "_state",
        "_vocab",
        "block_size",
        "is_prefill_worker",
        "num_blocks",
    )

    def __init__(
        self,
        args: EngineArgs,
        *,
        state: SchedulerState,
        kv: KvCache,
        mocker_kv: KvManager | None,
        preempter: Preempter,
        finisher: Finisher,
        sampler: SpeculativeSampler | None,
        vocab: Vocabulary,
        perf: PerfModel,
        fast_paths: bool = True,
    ) -> None:
        self._args = args
        self.block_size = args.block_size
        self.num_blocks = args.num_gpu_blocks
        self.is_prefill_worker = args.worker_type is WorkerType.PREFILL
        # Modelled time, never paced: upstream multiplies `decode_speedup_ratio` into a
        # positive `speedup_ratio` only, so an unpaced daemon's decode is the raw model's.
        self._decode_ratio = args.decode_speedup_ratio if args.speedup_ratio > 0 else 0.0
        self._state = state
        self._kv = kv
        # The same KV as the mocker's pool (None on vLLM's): the inlined block-opening step
        # and MTP reservations work on it alone.
        self._mocker_kv = mocker_kv
        self._preempter = preempter
        self._finisher = finisher
        # MTP: the mocker's bursts on its pool, vLLM's speculative decoding on vLLM's.
        self._mtp = sampler is not None
        self._bursts: BurstEmitter | None = None
        self._spec: SpecDecoder | None = None
        if sampler is not None and isinstance(kv, PagedKvManager):
            self._spec = SpecDecoder(
                sampler,
                num_spec=len(sampler.rates),
                kv=kv,
                finisher=finisher,
                decode_ms=self._decode_ms,
            )
        elif sampler is not None and mocker_kv is not None:
            self._bursts = BurstEmitter(
                sampler,
                state=state,
                kv=mocker_kv,
                preempter=preempter,
                finisher=finisher,
                decode_ms=self._decode_ms,
            )
        self._vocab = vocab
        self._perf = perf
        # Off only in the equivalence test of the hand-inlined decode step.
        self._fast_paths = fast_paths

    # --- helpers ------------------------------------------------------------------------

    def _decode_ms(self, batch: int, total_len: int, reserved: int = 0) -> float:
        if self.is_prefill_worker:
            return 0.0
        bs = self.block_size
        raw = self._perf.decode_ms(
            batch,
            (self._kv.num_active_blocks() - reserved) * bs,
            total_len // batch,
            self.num_blocks * bs,
        )
        return scale_ms(raw, self._decode_ratio)

    @property
    def spec_decoder(self) -> SpecDecoder | None:
        """MTP's verification under vLLM semantics (None without MTP or on the mocker's
        pool), for async scheduling's resolution of a batch."""
        return self._spec

    def modeled_decode_ms(self, batch: int, total_len: int) -> float:
        """The modeled duration of a decode batch now (async scheduling models a batch's
        time when it is scheduled)."""
        return self._decode_ms(batch, total_len)

    def finish(
        self, ctx: PassContext, req: RequestState, tokens: list[int], cleanup: list[BlockMove]
    ) -> None:
        """`req` ends with `tokens` (async scheduling's resolution of a batch)."""
        self._finisher.finish(ctx, req, tokens, cleanup)

    # --- the emission -------------------------------------------------------------------

    def emit(self, ctx: PassContext) -> float:
        """Emit every ready request's tokens into `ctx`; returns the decode duration (ms)."""
        state = self._state
        ready: list[RequestState] = []
        finished: list[RequestState] = []
        total_len = ctx.fused_len
        fused = ctx.fused
        # Where the fused steps go between the others (`PassContext.ready`), when fused.
        places: list[int] | None = None
        fused_ids = ctx.decoded_ids
        fused_tokens = ctx.decoded_tokens
        scheduled_ready = ctx.ready
        if scheduled_ready is None:
            for req in state.running:
                seq = req.seq
                length = len(seq.tokens)
                if req.num_computed_tokens >= length:
                    if seq.generated < seq.max_output_tokens:
                        ready.append(req)
                        total_len += length
                    else:
                        finished.append(req)
        elif scheduled_ready:
            places = []
            for req, place in scheduled_ready:
                seq = req.seq
                if seq.generated < seq.max_output_tokens:
                    ready.append(req)
                    places.append(place)
                    total_len += len(seq.tokens)
                else:
                    finished.append(req)
            # The others' entries are placed among the fused steps, which start over.
            ctx.decoded_ids = []
            ctx.decoded_tokens = []
        for req in finished:
            self._finisher.finish(ctx, req, [], req.seq.free_moves())
        if not ready:
            if not fused:
                return 0.0
            if places is not None:
                ctx.decoded_ids = fused_ids
                ctx.decoded_tokens = fused_tokens
            ctx.output_tokens += fused
            ctx.decode_forwards += fused
            return self._decode_ms(fused, total_len)
        if self._mtp:
            if self._spec is not None:
                return self._spec.emit(ctx, ready)
            bursts = self._bursts
            assert bursts is not None
            return bursts.emit(ctx, ready)
        decode_ms = self._decode_ms(len(ready) + fused, total_len)
        running_members = state.running_members
        kv = self._kv
        mocker_kv = self._mocker_kv
        offload = kv.offload is not None
        refresh = kv.refresh_offload_wait
        bs = self.block_size
        fast = self._fast_paths
        draw: Any = self._vocab.draw
        # The array's method itself: compiled, `tokens.append` looks the name up per call.
        append_token: Any = array.append
        outputs = ctx.outputs
        decoded_ids = ctx.decoded_ids
        decoded_tokens = ctx.decoded_tokens
        # Every output of this loop carries exactly one token: their count is the tokens'.
        first_output = len(outputs)
        first_decode = len(decoded_ids) - (0 if places is not None else fused)
        # NOTE: locals, so compiled code does not look the globals up once per token.
        output = RequestOutput
        running = _RUNNING
        taken = 0
        for k, req in enumerate(ready):
            if places is not None:
                place = places[k]
                if place > taken:
                    decoded_ids += fused_ids[taken:place]
                    decoded_tokens += fused_tokens[taken:place]
                    taken = place
            request_id = req.request_id
            seq = req.seq
            tokens = seq.tokens
            if (
                fast
                and seq.planned is None
                and seq.stops is None
                # The mocker's pool allocates the block a token opens; vLLM's hashes the block
                # a token fills (`push_paged`). Either way the general path does that.
                and (
                    len(tokens) % bs != 0 if mocker_kv is not None else (len(tokens) + 1) % bs != 0
                )
                and seq.generated + 1 < seq.max_output_tokens
                and req.cached_tokens_reported
                and req.status is running
            ):
                # The common decode step, inlined: same draw and effect as `generate_token` for
                # a token that neither opens a block nor ends the request (only a token that
                # opens a block is ever `popped`).
                # NOTE: typed Any so that, compiled, a drawn token stays the Python int the
                # draw made: as an `int` it would be unboxed, then boxed again for the token
                # array and for the output's list, two allocations per token.
                bits: Any = seq.token_bits
                drawn: Any = bits(32) if draw is None else draw(bits)
                append_token(tokens, drawn)
                seq.generated += 1
                decoded_ids.append(request_id)
                decoded_tokens.append(drawn)
                continue
            if (
                mocker_kv is not None
                and fast
                and not offload
                and seq.planned is None
                and seq.stops is None
                and len(tokens) % bs == 0
                and seq.popped is None
                and seq.generated + 1 < seq.max_output_tokens
                and req.cached_tokens_reported
                and req.status is running
            ):
                # The decode step that opens a block, inlined: the same draw and effects as
                # `generate_token` and `apply_all` of its moves (Promote, then the new block).
                bits = seq.token_bits
                token = bits(32) if draw is None else draw(bits)
                promote = seq.open_block(token)
                if promote is not None:
                    mocker_kv.promote(promote)
                if mocker_kv.use_partial(seq.partial):
                    seq.num_allocated_tokens = len(tokens)
                    decoded_ids.append(request_id)
                    decoded_tokens.append(token)
                    continue
                # No block: as the general path, undo, preempt, and retry unless it was us.
                seq.pop()
                victim = self._preempter.preempt()
                if victim is None or victim == request_id:
                    continue
            token = 0
            cleanup: list[BlockMove] = []
            sampled = completed = False
            while request_id in running_members:
                if offload and req.offload_wait_live(refresh):
                    break
                token, moves = seq.generate_token()
                completed = seq.finished()
                if completed:
                    cleanup = [m for m in moves if type(m) is Deref or type(m) is Release]
                    moves = [m for m in moves if type(m) is not Deref and type(m) is not Release]
                if not moves or kv.apply_all(moves, ctx.now_ms):
                    if moves and not completed:
                        seq.num_allocated_tokens = len(seq.tokens)
                    sampled = True
                    break
                seq.pop()
                if offload:
                    wait = kv.take_offload_wait()
                    if wait is not None:
                        req.offload_wait = wait
                        break
                victim = self._preempter.preempt()
                if victim is None or victim == request_id:
                    break
            if not sampled:
                continue
            if completed:
                self._finisher.finish(ctx, req, [token], cleanup)
                continue
            cached = req.take_cached_tokens()
            if cached is None:
                decoded_ids.append(request_id)
                decoded_tokens.append(token)
            else:
                ctx.add_output(output(request_id, [token], None, cached))
        if places is not None and taken < fused:
            decoded_ids += fused_ids[taken:]
            decoded_tokens += fused_tokens[taken:]
        emitted = len(outputs) - first_output + len(decoded_ids) - first_decode
        ctx.output_tokens += emitted
        ctx.decode_forwards += emitted
        return decode_ms if emitted else 0.0
