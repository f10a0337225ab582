"""Dynamo's `generate` endpoint on top of an engined daemon, in the three disaggregation modes.

Dynamo hands the worker a preprocessed request (token ids, stop conditions, routing) and
a `Context`, and streams back chunks shaped as Rust's `LLMEngineOutput`: `token_ids` and
`index` on every chunk, `finish_reason` and `completion_usage` on the last. The handler maps
that onto the control protocol (one engined request per Dynamo request, its id the
context's) and owns the request until it ends: whichever way the Dynamo side goes away (the
context is stopped or killed, the response stream is dropped), the engined request is
cancelled once and its KV freed.

Prefill/decode follows Dynamo 1.6.1's PrefillRouter: a prefill worker runs the prompt as a
handoff source (`submit_handoff_prefill`, max_tokens 1) and returns `disaggregated_params`
naming the handoff, its daemon and rank; the decode worker reserves a destination for it,
waits out the modeled transfer, activates it, releases the source on the prefill daemon (as
vLLM's decode side frees the prefill's blocks) and streams the decode. The request's fields
are read and checked in `engined.dynamo.request_fields`; its LoRA adapter (named by `model`,
passed to both sides of a handoff) is `engined.dynamo.lora`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol, TypeVar

import msgspec
import structlog

from engined.client import ClientClosedError, DaemonLost, EngineClient, EngineError
from engined.client.handoff_coordinator import (
    CALL_TIMEOUT_S,
    Coordinator,
    DestinationRequest,
    HandoffFailed,
    held_source,
    transfer_wait_s,
)
from engined.dynamo.engine_outputs import (
    Choice,
    OutputOptions,
    RequestFailed,
    Usage,
    http_error,
    merge,
    output_options,
)
from engined.dynamo.lora import BASE_MODEL_ONLY, BaseModelOnly, LoraAdapters
from engined.dynamo.request_fields import (
    PARAMS_KEY,
    core_fields,
    handoff_params,
    pin_rank,
    prefill_cached_tokens,
    single_sample,
    stop_fields,
)
from engined.dynamo.worker_args import DisaggregationMode
from engined.model_clock import ModelClock
from engined.wire.control import DestinationReservedEvent, TransferTiming, WireLoraRequest

log = structlog.get_logger(__name__)
T = TypeVar("T")

# engined error code -> HTTP status the frontend returns (vLLM's choices: a bad request is
# 400, an engine that cannot take more work right now is 503).
_HTTP_STATUS: Final = {
    "invalid_request": 400,
    "capacity": 400,
    "duplicate_request": 409,
    "unsupported": 400,
    "overloaded": 503,
    "shutting_down": 503,
    "bad_message": 500,
}


def refusal(exc: EngineError) -> RequestFailed:
    return RequestFailed(_HTTP_STATUS.get(exc.code, 500), f"engined {exc.code}: {exc.message}")


Context = Any  # dynamo._core.Context: id(), async_killed_or_stopped(), is_stopped()
Chunk = dict[str, Any]
__all__ = ["Gate", "Limits", "RequestFailed", "RequestHandler", "refusal"]


class Gate(Protocol):
    """Whether requests may reach the daemon now (`engined.dynamo.recovery`'s follower)."""

    @property
    def serving(self) -> bool: ...

    def refusal(self) -> Exception:
        """What a request gets while not `serving`, and a stream when the daemon goes."""


@dataclass(frozen=True, slots=True)
class Limits:
    """What the handler needs of the daemon it forwards to."""

    control_endpoint: str
    context_length: int
    speedup_ratio: float
    # The model's, for made-up logprobs (engined.logprob_values draws ids below it).
    vocab_size: int = 1


class RequestHandler:
    """Serves `generate` for one daemon; `connect` opens clients to prefill daemons."""

    def __init__(
        self,
        client: EngineClient,
        mode: DisaggregationMode,
        limits: Limits,
        *,
        connect: Callable[[str], Awaitable[EngineClient]],
        rank: int | None = None,
        adapters: LoraAdapters | BaseModelOnly = BASE_MODEL_ONLY,
    ) -> None:
        self._client = client
        # The adapter a request's `model` names (`--enable-lora`, engined.dynamo.lora).
        self._adapters = adapters
        # `--worker-per-rank`: every request goes to this rank (`pin_rank`).
        self._rank = rank
        # Set once the worker follows its daemon; not a wrapping generator (a re-yield per chunk).
        self.gate: Gate | None = None
        self._mode = mode
        self._limits = limits
        self._handoffs = Coordinator(client, connect)
        self.in_flight = 0

    async def close(self) -> None:
        await self._handoffs.close()

    async def generate(self, request: dict[str, Any], context: Context) -> AsyncIterator[Chunk]:
        """Dynamo's handler: an async generator of `LLMEngineOutput` chunks. Behind a `gate`,
        refused while the daemon is gone or not set up again, and ended so when the daemon
        goes mid-stream: a request never reaches a daemon without its vocabulary, and never
        hangs on one that is gone."""
        gate = self.gate
        if gate is not None and not gate.serving:
            raise gate.refusal()
        if self._rank is not None:
            pin_rank(request, self._rank)
        self.in_flight += 1
        try:
            async with self._adapters.admitted(request.get("model")) as lora:
                # Set up here, so each chunk passes one re-yielding generator fewer.
                source: AsyncIterator[Chunk] | None
                if self._mode is DisaggregationMode.PREFILL:
                    source = self._prefill(request, context, lora)
                elif self._mode is DisaggregationMode.DECODE and request.get("prefill_result"):
                    source = await self._decode(request, context, lora)
                else:
                    source = await self._aggregated(request, context, lora)
                if source is None:
                    return
                async for chunk in source:
                    yield chunk
        except RequestFailed as exc:
            raise http_error(exc) from None
        except DaemonLost:
            if gate is None:
                raise
            raise gate.refusal() from None  # migratable (engined.dynamo.recovery)
        except ClientClosedError:
            raise http_error(RequestFailed(503, "the engined daemon went away")) from None
        finally:
            self.in_flight -= 1

    # --- the three modes ------------------------------------------------------------------

    async def _aggregated(
        self, request: dict[str, Any], context: Context, lora: WireLoraRequest | None
    ) -> AsyncIterator[Chunk]:
        """Submit the request (each of its `n` choices) and return its chunks' stream."""
        token_ids, max_tokens, dp_rank, seed = core_fields(request, self._limits.context_length)
        stop_token_ids, min_tokens = stop_fields(request)
        options = output_options(request)
        request_id = _request_id(context)
        usage = Usage(len(token_ids))
        # n > 1 as vLLM's ParentRequest fans it out: child `{j}_{id}`, seed + j.
        ids = [request_id] if options.n == 1 else [f"{j}_{request_id}" for j in range(options.n)]
        streams: list[AsyncGenerator[Chunk, None]] = []
        try:
            for j, child in enumerate(ids):
                submitted = await _refusing(
                    self._client.submit(
                        token_ids,
                        max_tokens,
                        request_id=child,
                        dp_rank=dp_rank,
                        seed=None if seed is None else seed + j,
                        stop_token_ids=stop_token_ids,
                        min_tokens=min_tokens,
                        lora_request=lora,
                        timeout=CALL_TIMEOUT_S,
                    )
                )
                choice = Choice(j, usage, options, self._limits.vocab_size, token_ids)
                streams.append(self._entries(submitted.request_id, choice, context))
        except BaseException:
            for stream in streams:
                await stream.aclose()  # never started: cancels its request
            raise
        return streams[0] if len(streams) == 1 else _interleaved(streams)

    async def _prefill(
        self, request: dict[str, Any], context: Context, lora: WireLoraRequest | None
    ) -> AsyncIterator[Chunk]:
        # The prefill makes one token whatever the client asked: Dynamo's PrefillRouter sends
        # `max_tokens` 1 with the client's `min_tokens`, which dynamo.vllm caps to 1 as well.
        stop = request.get("stop_conditions") or {}
        if isinstance(stop, dict):
            request = {**request, "stop_conditions": {**stop, "max_tokens": 1, "min_tokens": 1}}
        token_ids, _, dp_rank, seed = core_fields(request, self._limits.context_length)
        single_sample(request)
        handoff_id = request_id = _request_id(context)
        submitted = await _refusing(
            self._client.submit_handoff_prefill(
                handoff_id,
                token_ids,
                1,
                request_id=request_id,
                dp_rank=dp_rank,
                seed=seed,
                lora_request=lora,
                timeout=CALL_TIMEOUT_S,
            )
        )
        choice = Choice(0, Usage(len(token_ids)), OutputOptions(), 1, token_ids)
        last: Chunk | None = None
        async for chunk in self._entries(submitted.request_id, choice, context):
            last = chunk
        if last is None or last.get("finish_reason") != "length":
            # Cancelled before the prompt was done: nothing is held, nothing to release.
            self._handoffs.abandon_source(handoff_id)
            if last is not None:
                yield last
            return
        # The source is held from the pass that finished the prompt.
        try:
            held = await held_source(self._client, handoff_id)
        except HandoffFailed as exc:
            raise RequestFailed(500, str(exc)) from None
        params: dict[str, Any] = {
            "handoff_id": handoff_id,
            "control_endpoint": self._limits.control_endpoint,
            "dp_rank": submitted.dp_rank,
            "handoff_delay_ms": choice.handoff_delay_ms,
            "speedup_ratio": self._limits.speedup_ratio,
        }
        if held is not None and held.transfer_timing is not None:
            params["transfer_timing"] = msgspec.to_builtins(held.transfer_timing)
        last["disaggregated_params"] = {PARAMS_KEY: params}
        yield last

    async def _decode(
        self, request: dict[str, Any], context: Context, lora: WireLoraRequest | None
    ) -> AsyncIterator[Chunk] | None:
        """Pull the prefill's handoff and return the decode's chunks (None: the Dynamo side
        went away meanwhile)."""
        token_ids, max_tokens, dp_rank, seed = core_fields(request, self._limits.context_length)
        stop_token_ids, min_tokens = stop_fields(request)
        options = single_sample(request)
        prefill_result = request["prefill_result"]
        params = handoff_params(prefill_result)
        handoff_id = params["handoff_id"]
        peer = await self._handoffs.peer(params["control_endpoint"])
        destination = DestinationRequest(
            token_ids,
            max_tokens,
            request_id=_request_id(context),
            dp_rank=dp_rank,
            seed=seed,
            stop_token_ids=stop_token_ids,
            min_tokens=min_tokens,
            lora_request=lora,
        )
        accepted = await _refusing(
            self._handoffs.pull(
                handoff_id,
                peer,
                destination,
                lambda reserved: _transfer_wait_s(params, reserved),
                stopped=context.async_killed_or_stopped,
            )
        )
        if accepted is None:
            return None
        usage = Usage(len(token_ids))
        usage.cached_tokens = prefill_cached_tokens(prefill_result)
        choice = Choice(0, usage, options, self._limits.vocab_size, token_ids)
        return self._entries(accepted.request_id, choice, context)

    # --- streaming and ownership ------------------------------------------------------------

    async def _entries(
        self, request_id: str, choice: Choice, context: Context
    ) -> AsyncGenerator[Chunk, None]:
        """The request's chunks, one per engine output while Dynamo asks for each as it
        comes, else one for what queued meanwhile; cancels the request in the daemon if the
        Dynamo side goes first."""
        watcher = asyncio.ensure_future(self._cancel_when_stopped(request_id, context))
        finished = False
        try:
            async for batch in self._client.output_batches(request_id, timeout=None):
                entry = batch[0] if len(batch) == 1 else merge(batch)
                finished = entry.finished
                yield choice.chunk(entry)
        finally:
            watcher.cancel()
            if not finished:
                # The consumer went away (the stream was dropped) or the context stopped.
                self._handoffs.spawn(self._cancel(request_id))

    async def _cancel_when_stopped(self, request_id: str, context: Context) -> None:
        await context.async_killed_or_stopped()
        await self._cancel(request_id)

    async def _cancel(self, request_id: str) -> None:
        await self._client.abandon(request_id, timeout=CALL_TIMEOUT_S)


async def _interleaved(
    streams: list[AsyncGenerator[Chunk, None]],
) -> AsyncIterator[Chunk]:
    """The chunks of several choices as each comes. A choice's next chunk is asked for only
    once Dynamo has taken its last one, so what queues meanwhile is merged as for one."""
    pending = {asyncio.ensure_future(anext(stream)): stream for stream in streams}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in [t for t in pending if t in done]:
                stream = pending.pop(task)
                try:
                    chunk = task.result()
                except StopAsyncIteration:
                    continue
                yield chunk
                pending[asyncio.ensure_future(anext(stream))] = stream
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


async def _refusing(call: Awaitable[T]) -> T:
    """`call`'s result; an engined refusal becomes the RequestFailed the client is shown."""
    try:
        return await call
    except EngineError as exc:
        raise refusal(exc) from None


def _request_id(context: Context) -> str:
    if context is not None:
        with contextlib.suppress(Exception):
            value = context.id()
            if isinstance(value, str) and value:
                return value
    return str(uuid.uuid4())


def _transfer_wait_s(params: dict[str, Any], reserved: DestinationReservedEvent) -> float:
    """The modeled KV transfer time (engined.client.handoff_coordinator) from the prefill worker's
    params; a malformed `transfer_timing` is a 400 naming it."""
    speedup = params.get("speedup_ratio") or 0.0
    if not isinstance(speedup, int | float) or speedup <= 0:
        return 0.0
    timing = params.get("transfer_timing")
    wire_timing: TransferTiming | None = None
    delay_ms = params.get("handoff_delay_ms") or 0.0
    if timing is None:
        if not isinstance(delay_ms, int | float):
            return 0.0
    else:
        try:
            wire_timing = msgspec.convert(timing, TransferTiming)
        except msgspec.ValidationError as exc:
            raise RequestFailed(
                400, f"prefill_result.disaggregated_params.engined.transfer_timing: {exc}"
            ) from None
    return transfer_wait_s(
        wire_timing,
        float(delay_ms) if isinstance(delay_ms, int | float) else 0.0,
        ModelClock(float(speedup)),
        reserved,
    )
