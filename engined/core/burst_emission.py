"""MTP (multi-token prediction) emission: each ready request emits a burst of tokens.

Apart from the plain emitter (emission.py) because a burst allocates differently: the blocks
of every ready request's largest burst are reserved first (preempting until they fit), so no
token inside a burst can fail to get its block, and the pass's decode time is modeled with
the reservation not counted as active. Runs on the mocker's lineage pool only.
"""

from __future__ import annotations

from collections.abc import Callable

from engined.core.block_moves import Deref, Use
from engined.core.finish import Finisher
from engined.core.kv_manager import KvManager
from engined.core.pass_context import PassContext
from engined.core.preemption import Preempter
from engined.core.sequence import BlockMove
from engined.core.speculative import SpeculativeSampler
from engined.core.state import RequestState, SchedulerState
from engined.core.types import RequestOutput

# The decode time of `batch` requests of `total_len` tokens with `reserved` blocks set aside.
DecodeMs = Callable[[int, int, int], float]


class BurstEmitter:
    __slots__ = (
        "_decode_ms",
        "_finisher",
        "_kv",
        "_preempter",
        "_sampler",
        "_state",
        "block_size",
        "is_prefill_worker",
    )

    def __init__(
        self,
        sampler: SpeculativeSampler,
        *,
        state: SchedulerState,
        kv: KvManager,
        preempter: Preempter,
        finisher: Finisher,
        decode_ms: DecodeMs,
    ) -> None:
        self._sampler = sampler
        self._state = state
        self._kv = kv
        self._preempter = preempter
        self._finisher = finisher
        self._decode_ms = decode_ms
        self.block_size = kv.block_size
        self.is_prefill_worker = finisher.is_prefill_worker

    def emit(self, ctx: PassContext, ready: list[RequestState]) -> float:
        """Reserve blocks for every ready request's largest burst, then sample the bursts;
        returns the decode duration (ms)."""
        sampler = self._sampler
        state = self._state
        kv = self._kv
        bs = self.block_size
        max_burst = 1 if self.is_prefill_worker else len(sampler.rates) + 1
        offload = kv.offload is not None
        refresh = kv.refresh_offload_wait
        if offload and any(req.offload_wait_live(refresh) for req in ready):
            return 0.0
        while True:
            required = 0
            for req in ready:
                seq = req.seq
                length = len(seq.tokens)
                burst = min(max_burst, seq.max_output_tokens - seq.generated)
                required += -(-(length + burst) // bs) - -(-length // bs)
            reservation = kv.reserve_slots(required, ctx.now_ms)
            if reservation is not None:
                break
            if offload:
                wait = kv.take_offload_wait()
                if wait is not None:
                    # The reservation evicted blocks still being copied out: nobody bursts.
                    for req in ready:
                        req.offload_wait = wait
                    return 0.0
            if self._preempter.preempt() is None:
                return 0.0
            ready = [
                r
                for r in state.running
                if r.num_computed_tokens == len(r.seq.tokens)
                and r.seq.generated < r.seq.max_output_tokens
            ]
            if not ready:
                return 0.0
        total_len = sum(len(req.seq.tokens) for req in ready)
        decode_ms = self._decode_ms(len(ready), total_len, len(reservation))
        bursts = [
            (
                req,
                min(req.seq.max_output_tokens - req.seq.generated, 1)
                if self.is_prefill_worker
                else sampler.sample_output_tokens(req.seq.max_output_tokens - req.seq.generated),
            )
            for req in ready
        ]
        emitted = 0
        now_ms = ctx.now_ms
        for req, burst in bursts:
            seq = req.seq
            done = False
            cleanup: list[BlockMove] = []
            tokens: list[int] = []
            for _ in range(burst):
                token, moves = seq.generate_token()
                done = seq.finished()
                for move in moves:
                    if type(move) is Deref and done:
                        cleanup.append(move)
                        continue
                    ok = (
                        kv.use(move, now_ms, reservation)
                        if isinstance(move, Use)
                        else kv.apply(move, now_ms)
                    )
                    assert ok, "reserved decode allocation must be infallible"
                if not done:
                    seq.num_allocated_tokens = len(seq.tokens)
                tokens.append(token)
                if done:
                    break
            emitted += len(tokens)
            # The mocker's reading of vLLM's stats: every burst a draft of `nextn` tokens (a
            # request's first too), its tokens beyond the first the accepted ones.
            ctx.accepted(len(sampler.rates), len(tokens) - 1)
            if done:
                self._finisher.finish(ctx, req, tokens, cleanup)
            else:
                if tokens:
                    ctx.add_output(
                        RequestOutput(req.request_id, tokens, None, req.take_cached_tokens())
                    )
                req.num_computed_tokens = len(seq.tokens) - 1
        kv.release_slots(reservation)
        ctx.output_tokens += emitted
        ctx.decode_forwards += len(bursts)
        return decode_ms
