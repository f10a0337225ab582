"""Token emission at the end of a pass: one token per ready request, or an MTP burst.

A request is ready when its KV has caught up with its tokens. Sampling a token that opens a
new block allocates that block at once (mocker 1.3.0's eager allocation); when the pool is
full that preempts the newest running request, possibly the sampling one, and the token is
retried or dropped. A request with nothing left to generate (max_tokens 0) completes here
with a token-less terminal signal, after its prefill: upstream 1.3.0 never completed such
requests, a defect fixed later, and we follow the fix.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from engined.core.perf_model import scale_ms
from engined.core.sequence import BlockMove, Deref, Use
from engined.core.state import RequestState
from engined.core.types import OutputSignal

if TYPE_CHECKING:
    from engined.core.scheduler import VllmCore


def handoff_delay_ms(core: VllmCore, completed: bool, prompt_len: int) -> float | None:
    """KV transfer time of a prefill worker's finished request (always the full prompt)."""
    if not completed or not core.is_prefill_worker:
        return None
    bpt = core.args.kv_bytes_per_token
    bandwidth = core.args.kv_transfer_bandwidth
    if bpt is None or bandwidth is None or bandwidth <= 0:
        return None
    return prompt_len * bpt / (bandwidth * 1e9) * 1000.0


def _take_cached(req: RequestState) -> int | None:
    if req.cached_tokens_reported:
        return None
    req.cached_tokens_reported = True
    return req.cached_prefix_tokens


def _decode_ms(core: VllmCore, batch: int, total_len: int, reserved: int = 0) -> float:
    if core.is_prefill_worker:
        return 0.0
    bs = core.block_size
    raw = core.perf.decode_ms(
        batch,
        (core.kv.num_active_blocks() - reserved) * bs,
        total_len // batch,
        core.num_blocks * bs,
    )
    args = core.args
    return scale_ms(raw, args.speedup_ratio * args.decode_speedup_ratio)


def emit_ready_tokens(core: VllmCore) -> tuple[float, list[OutputSignal], int, int]:
    """Returns (decode duration ms, signals, decode forwards, output tokens).

    Every signal after the token-less terminals carries a token, so the token count is
    known without another pass over the signals.
    """
    state = core.state
    requests = state.requests
    ready: list[RequestState] = []
    finished: list[RequestState] = []
    total_len = 0
    for request_id in state.running:
        req = requests[request_id]
        seq = req.seq
        length = len(seq.tokens)
        if req.num_computed_tokens >= length:
            if seq.generated < seq.max_output_tokens:
                ready.append(req)
                total_len += length
            else:
                finished.append(req)
    signals: list[OutputSignal] = []
    for req in finished:
        signals.append(
            OutputSignal(
                req.request_id,
                None,
                True,
                False,
                handoff_delay_ms(core, True, req.seq.num_input_tokens),
                _take_cached(req),
            )
        )
        core.complete_source(req, req.seq.free_moves())
    if not ready:
        return 0.0, signals, 0, 0
    if core.sampler is not None:
        decode_ms, signals, forwards = _emit_speculative(core, ready, signals)
        return decode_ms, signals, forwards, len(signals) - len(finished)
    decode_ms = _decode_ms(core, len(ready), total_len)
    running_members = state.running_members
    kv = core.kv
    offload = kv.offload is not None
    emitted_any = False
    bs = core.block_size
    getrandbits = core.rng.getrandbits
    draw = core.vocab.draw
    append = signals.append
    for req in ready:
        request_id = req.request_id
        seq = req.seq
        tokens = seq.tokens
        if (
            seq.planned is None
            and len(tokens) % bs != 0
            and seq.generated + 1 < seq.max_output_tokens
            and req.cached_tokens_reported
            and request_id in running_members
        ):
            # The common decode step, inlined: same draw and effect as `generate_token` for a
            # token that neither opens a block nor ends the request.
            token = getrandbits(32) if draw is None else draw()
            tokens.append(token)
            seq.generated += 1
            append(OutputSignal(request_id, token, False))
            emitted_any = True
            continue
        token = 0
        cleanup: list[BlockMove] = []
        emitted = completed = False
        while request_id in running_members:
            if offload and core.offload_wait_live(req):
                break
            token, moves = seq.generate_token()
            completed = seq.generated >= seq.max_output_tokens
            if completed:
                cleanup = [m for m in moves if type(m) is Deref]
                moves = [m for m in moves if type(m) is not Deref]
            if not moves or kv.apply_all(moves):
                if moves and not completed:
                    seq.num_allocated_tokens = len(seq.tokens)
                emitted = True
                break
            seq.pop()
            if offload:
                blocked = kv.take_offload_wait()
                if blocked is not None:
                    req.offload_wait = blocked
                    break
            victim = core.preempt()
            if victim is None or victim == request_id:
                break
        if not emitted:
            continue
        emitted_any = True
        signals.append(
            OutputSignal(
                request_id,
                token,
                completed,
                False,
                handoff_delay_ms(core, completed, seq.num_input_tokens),
                _take_cached(req),
            )
        )
        if completed:
            core.complete_source(req, cleanup)
    num_tokens = len(signals) - len(finished)
    return (decode_ms if emitted_any else 0.0), signals, num_tokens, num_tokens


def _emit_speculative(
    core: VllmCore, ready: list[RequestState], signals: list[OutputSignal]
) -> tuple[float, list[OutputSignal], int]:
    """MTP: reserve blocks for every ready request's largest burst, then sample the bursts."""
    sampler = core.sampler
    assert sampler is not None
    state = core.state
    kv = core.kv
    bs = core.block_size
    max_burst = 1 if core.is_prefill_worker else len(sampler.rates) + 1
    offload = kv.offload is not None
    if offload and any(core.offload_wait_live(req) for req in ready):
        return 0.0, signals, 0
    while True:
        required = 0
        for req in ready:
            seq = req.seq
            length = len(seq.tokens)
            burst = min(max_burst, seq.max_output_tokens - seq.generated)
            required += -(-(length + burst) // bs) - -(-length // bs)
        reservation = kv.reserve_slots(required)
        if reservation is not None:
            break
        if offload:
            blocked = kv.take_offload_wait()
            if blocked is not None:
                # The reservation evicted blocks still being copied out: nobody bursts.
                for req in ready:
                    req.offload_wait = blocked
                return 0.0, signals, 0
        if core.preempt() is None:
            return 0.0, signals, 0
        ready = [
            state.requests[u]
            for u in state.running
            if state.requests[u].num_computed_tokens == len(state.requests[u].seq.tokens)
            and state.requests[u].seq.generated < state.requests[u].seq.max_output_tokens
        ]
        if not ready:
            return 0.0, signals, 0
    total_len = sum(len(req.seq.tokens) for req in ready)
    decode_ms = _decode_ms(core, len(ready), total_len, len(reservation))
    bursts = [
        (
            req,
            min(req.seq.max_output_tokens - req.seq.generated, 1)
            if core.is_prefill_worker
            else sampler.sample_output_tokens(req.seq.max_output_tokens - req.seq.generated),
        )
        for req in ready
    ]
    for req, burst in bursts:
        seq = req.seq
        done = False
        cleanup: list[BlockMove] = []
        for _ in range(burst):
            token, moves = seq.generate_token()
            done = seq.generated >= seq.max_output_tokens
            for move in moves:
                if type(move) is Deref and done:
                    cleanup.append(move)
                    continue
                ok = kv.use(move, reservation) if isinstance(move, Use) else kv.apply(move)
                assert ok, "reserved decode allocation must be infallible"
            if not done:
                seq.num_allocated_tokens = len(seq.tokens)
            signals.append(
                OutputSignal(
                    req.request_id,
                    token,
                    done,
                    False,
                    handoff_delay_ms(core, done, seq.num_input_tokens),
                    _take_cached(req),
                )
            )
            if done:
                break
        if done:
            core.complete_source(req, cleanup)
        else:
            req.num_computed_tokens = len(seq.tokens) - 1
    kv.release_slots(reservation)
    return decode_ms, signals, len(bursts)
