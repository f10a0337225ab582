"""`EngineClient`: the control protocol (v1) as async methods, one per message.

Used by the CLI tools, the Dynamo worker, the tests and the benchmarks. The socket, the
reader and the routing of replies and streams are `Connection`'s, the disaggregation calls
(a handoff's source and destination, lifecycle events) `HandoffCalls`'; each method here
builds one message and says which reply it expects.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass

from engined.client.client_errors import EngineError
from engined.client.dealer_connection import DEFAULT_TIMEOUT
from engined.client.handoff_calls import HandoffCalls, wire_request
from engined.client.pause_calls import PauseCalls
from engined.wire.constraints import KvCacheReportMode
from engined.wire.control import (
    Applied,
    Cancel,
    DestinationAccepted,
    DirectReply,
    FinishReason,
    Hello,
    Load,
    Metrics,
    MetricsReply,
    Noop,
    OutputEntry,
    Ping,
    Pong,
    ResetPrefixCache,
    SetFpmWorkerId,
    SetVocabulary,
    Stats,
    StatsReply,
    Submit,
    Submitted,
    WaitIdle,
    WatchLoad,
    Welcome,
    WireLoraRequest,
)


@dataclass(frozen=True, slots=True)
class Generation:
    """Everything one request produced (`EngineClient.generate`)."""

    request_id: str
    dp_rank: int
    token_ids: list[int]
    # None only when the stream ended without a finished entry: this client's own cancel on
    # an older daemon (a current one ends every stream with a terminal entry).
    finish_reason: FinishReason | None
    cached_tokens: int | None
    handoff_delay_ms: float | None
    # How many `output` entries carried the tokens (a speculative burst is one entry).
    num_outputs: int
    # The stop id that ended it, when `finish_reason` is "stop".
    stop_reason: int | None = None


class EngineClient(HandoffCalls, PauseCalls):
    """A connection to one daemon's control socket; build it with `await connect(...)`.

    Use it as `async with await EngineClient.connect(endpoint) as client:`, or call
    `close()`. Calls may run concurrently. Every call that waits on the daemon takes
    `timeout` (seconds, None = forever) and raises TimeoutError when it runs out.
    """

    # --- protocol calls -------------------------------------------------------------------

    async def hello(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> Welcome:
        return await self._call(Hello(id=self._next_id()), Welcome, timeout)

    async def submit(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        output_token_ids: Sequence[int] | None = None,
        dp_rank: int | None = None,
        seed: int | None = None,
        priority: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        min_tokens: int = 0,
        cache_salt: str | None = None,
        lora_request: WireLoraRequest | None = None,
        kv_cache_report_mode: KvCacheReportMode = "incremental",
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> Submitted:
        """Submit a request; read its outputs with `outputs(reply.request_id)`.

        With a `request_id` the output queue is registered before the message leaves, so no
        output can be missed; without one the daemon mints the id and outputs that beat the
        `submitted` reply are kept for `outputs()` all the same.
        """
        request = wire_request(
            token_ids,
            max_tokens,
            request_id,
            output_token_ids,
            dp_rank,
            seed,
            priority,
            stop_token_ids=stop_token_ids,
            min_tokens=min_tokens,
            cache_salt=cache_salt,
            lora_request=lora_request,
            kv_cache_report_mode=kv_cache_report_mode,
        )
        msg = Submit(request=request, id=self._next_id())
        return await self._call_with_stream(msg, Submitted, request_id, timeout)

    async def outputs(
        self, request_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> AsyncGenerator[OutputEntry, None]:
        """Yield the request's output entries until its finished one.

        Whoever cancels the request (this client, another one, the daemon), the last entry
        is a `cancelled` terminal; an older daemon sends none for this client's own cancel,
        and the stream then ends once that cancel was applied. `timeout` bounds the wait
        for each entry.
        """
        async with contextlib.aclosing(self._entries(request_id, timeout, backlog=False)) as lists:
            async for (entry,) in lists:
                yield entry

    def output_batches(
        self, request_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> AsyncGenerator[list[OutputEntry], None]:
        """Like `outputs`, but each item is every entry that had arrived by then, in order.

        A consumer slower than the engine (a relay such as the Dynamo worker) then pays its
        per-item cost once per backlog instead of once per pass, as vLLM's output collector
        merges the deltas its consumer has not taken yet. The lists are `_entries`' own
        generator, not re-yielded by another: a relay pays for one generator per item.
        """
        return self._entries(request_id, timeout, backlog=True)

    async def stream(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        output_token_ids: Sequence[int] | None = None,
        dp_rank: int | None = None,
        seed: int | None = None,
        priority: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        min_tokens: int = 0,
        cache_salt: str | None = None,
        lora_request: WireLoraRequest | None = None,
        kv_cache_report_mode: KvCacheReportMode = "incremental",
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> AsyncGenerator[OutputEntry, None]:
        """`submit` then `outputs`: the request's entries until its finished one."""
        submitted = await self.submit(
            token_ids,
            max_tokens,
            request_id=request_id,
            output_token_ids=output_token_ids,
            dp_rank=dp_rank,
            seed=seed,
            priority=priority,
            stop_token_ids=stop_token_ids,
            min_tokens=min_tokens,
            cache_salt=cache_salt,
            lora_request=lora_request,
            kv_cache_report_mode=kv_cache_report_mode,
            timeout=timeout,
        )
        async for entry in self.outputs(submitted.request_id, timeout=timeout):
            yield entry

    async def generate(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        output_token_ids: Sequence[int] | None = None,
        dp_rank: int | None = None,
        seed: int | None = None,
        priority: int = 0,
        stop_token_ids: Sequence[int] | None = None,
        min_tokens: int = 0,
        cache_salt: str | None = None,
        lora_request: WireLoraRequest | None = None,
        kv_cache_report_mode: KvCacheReportMode = "incremental",
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> Generation:
        """Submit and collect every output of the request."""
        submitted = await self.submit(
            token_ids,
            max_tokens,
            request_id=request_id,
            output_token_ids=output_token_ids,
            dp_rank=dp_rank,
            seed=seed,
            priority=priority,
            stop_token_ids=stop_token_ids,
            min_tokens=min_tokens,
            cache_salt=cache_salt,
            lora_request=lora_request,
            kv_cache_report_mode=kv_cache_report_mode,
            timeout=timeout,
        )
        return await self.collect(submitted, timeout=timeout)

    async def collect(
        self,
        submitted: Submitted | DestinationAccepted,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> Generation:
        """Gather the outputs of a submitted request (a handoff prefill, an accepted
        destination too) into one value."""
        tokens: list[int] = []
        finish_reason: FinishReason | None = None
        cached_tokens: int | None = None
        handoff_delay_ms: float | None = None
        stop_reason: int | None = None
        count = 0
        async for entry in self.outputs(submitted.request_id, timeout=timeout):
            count += 1
            tokens.extend(entry.token_ids)
            if entry.cached_tokens is not None and cached_tokens is None:
                cached_tokens = entry.cached_tokens
            if entry.handoff_delay_ms is not None:
                handoff_delay_ms = entry.handoff_delay_ms
            finish_reason = entry.finish_reason
            stop_reason = entry.stop_reason
        return Generation(
            request_id=submitted.request_id,
            dp_rank=submitted.dp_rank,
            token_ids=tokens,
            finish_reason=finish_reason,
            cached_tokens=cached_tokens,
            handoff_delay_ms=handoff_delay_ms,
            num_outputs=count,
            stop_reason=stop_reason,
        )

    async def cancel(
        self, request_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied | Noop:
        """Cancel a request of this client's, or anyone's on an operator connection.

        `applied` when it was active: its owner's stream ends with a `cancelled` terminal,
        which comes before the `applied` when the owner is this client; no more output
        follows. `noop` when it was unknown, had already ended, or is another client's and
        this connection is not an operator's (protocol §1.5).
        """
        reply = await self._call_either(Cancel(request_id=request_id, id=self._next_id()), timeout)
        if isinstance(reply, Applied):
            self._end_stream(request_id)
        return reply

    def forget(self, request_id: str) -> None:
        """Drop what this client holds of a request's stream, unread outputs included (a
        reader of it ends): for a caller done with a request it will not read to its end,
        since a `cancel` answered `noop` (the request had already finished) leaves them
        queued for a reader that will never come."""
        self._end_stream(request_id)

    async def abandon(self, request_id: str, *, timeout: float | None = DEFAULT_TIMEOUT) -> None:
        """Cancel a request nobody will read to its end and `forget` its stream, whatever the
        daemon answers, or if it does not (a relay whose own client went away)."""
        try:
            with contextlib.suppress(EngineError, TimeoutError, ConnectionError):
                await self.cancel(request_id, timeout=timeout)
        finally:
            self.forget(request_id)

    @property
    def open_streams(self) -> int:
        """The requests whose outputs this client holds, read or not yet."""
        return len(self._streams)

    async def stats(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> StatsReply:
        return await self._call(Stats(id=self._next_id()), StatsReply, timeout)

    async def metrics(
        self, accept: str | None = None, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> MetricsReply:
        """The daemon's Prometheus exposition, as its `/metrics` serves it to a scraper that
        sent `accept` as its Accept header (None: the text format)."""
        return await self._call(Metrics(accept=accept, id=self._next_id()), MetricsReply, timeout)

    async def ping(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> Pong:
        return await self._call(Ping(id=self._next_id()), Pong, timeout)

    async def wait_idle(
        self, dp_rank: int | None = None, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> StatsReply:
        """The stats once `dp_rank` (every rank when None) is idle: nothing queued, running
        or parked, everything sent before applied and its outputs delivered."""
        msg = WaitIdle(dp_rank=dp_rank, id=self._next_id())
        return await self._call(msg, StatsReply, timeout)

    async def reset_prefix_cache(
        self,
        dp_rank: int | None = None,
        *,
        reset_running_requests: bool = False,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> Applied:
        """Clear the prefix cache of `dp_rank`, or of every rank when None; with
        `reset_running_requests`, vLLM's: preempt the running requests first."""
        msg = ResetPrefixCache(
            dp_rank=dp_rank, reset_running_requests=reset_running_requests, id=self._next_id()
        )
        return await self._call(msg, Applied, timeout)

    async def set_vocabulary(
        self,
        vocab_size: int | None,
        excluded_token_ids: Sequence[int] = (),
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> Applied:
        """Draw generated ids from `[0, vocab_size)` minus `excluded_token_ids`, every rank."""
        msg = SetVocabulary(
            vocab_size=vocab_size, excluded_token_ids=list(excluded_token_ids), id=self._next_id()
        )
        return await self._call(msg, Applied, timeout)

    async def set_fpm_worker_id(
        self,
        worker_id: str,
        *,
        dp_rank: int | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> Applied:
        """Stamp the forward-pass metrics of `dp_rank`, or of every rank when None, with
        `worker_id` from now on."""
        msg = SetFpmWorkerId(worker_id=worker_id, dp_rank=dp_rank, id=self._next_id())
        return await self._call(msg, Applied, timeout)

    async def watch_load(
        self, on_load: Callable[[Load], None], *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied:
        """Call `on_load` (from the reader task) with every `load` message from now on.

        The daemon sends each rank's load at once, then whenever it changes.
        """
        self._on_load = on_load
        return await self._call(WatchLoad(id=self._next_id()), Applied, timeout)

    async def send_raw(
        self, body: bytes, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> DirectReply:
        """Send `body` as is and return the direct reply, an `ErrorReply` included.

        For tests of malformed input. The reply is matched as the oldest unclaimed direct
        reply, since a broken body's `id` may be unreadable; do not put an int `id` in
        `body` that a concurrent call of this client may be using.
        """
        self._check_usable()
        future: asyncio.Future[DirectReply] = asyncio.get_running_loop().create_future()
        self._raw_waiters.append(future)
        try:
            async with asyncio.timeout(timeout):
                await self._sock.send_multipart((body,))
                return await future
        finally:
            if future in self._raw_waiters:
                self._raw_waiters.remove(future)
