"""asyncio client of the control protocol (v1), used by the CLI, the tests and the benchmarks.

One DEALER socket and one reader task. Every message the client sends carries an int `id`
it picked; the reader resolves the waiting call's future when the direct reply echoing that
`id` arrives, and routes streamed messages by what they name: `output` entries to a queue per
request, `lifecycle` events to a queue per handoff and to one general feed. Nothing is lost
between a call and its consumer: a request's output queue is registered before its submit
is sent, and a message naming a request or handoff without a queue creates one.

The reader never dies silently: if it fails, the failure is logged, every waiting call and
every stream raises it, and later calls raise `ClientClosedError`.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self, TypeAlias, TypeVar

import structlog
import zmq
import zmq.asyncio

from engined.wire.control import (
    ActivateDestination,
    Applied,
    Cancel,
    CancelDestination,
    CancelSource,
    ClientMessage,
    DaemonMessage,
    DestinationAccepted,
    DirectReply,
    ErrorCode,
    ErrorReply,
    FinishReason,
    Hello,
    Lifecycle,
    Load,
    Noop,
    Output,
    OutputEntry,
    Ping,
    Pong,
    ReleaseSource,
    ReplyDecoder,
    ReserveDestination,
    ResetPrefixCache,
    SetFpmWorkerId,
    SetVocabulary,
    Stats,
    StatsReply,
    Submit,
    SubmitHandoffPrefill,
    Submitted,
    WatchLoad,
    Welcome,
    WireError,
    WireLifecycleEvent,
    WireRequest,
    encode_message,
)
from engined.zmq_sockets import make_socket

log = structlog.get_logger()

DEFAULT_TIMEOUT: Final = 30.0
# A client reads everything at once into its queues, so these only bound bursts.
_HWM: Final = 10_000
# The general lifecycle feed keeps the newest events only: a caller that reads per handoff
# never drains it.
LIFECYCLE_FEED_SIZE: Final = 10_000

R = TypeVar("R", bound=DirectReply)
_T = TypeVar("_T")


class EngineError(Exception):
    """The daemon answered `error`.

    Attributes:
        code: the protocol error code (`bad_message`, `duplicate_request`, ...).
        message: the daemon's human-readable message, naming the offending field.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ErrorCode = code
        self.message = message


class ProtocolError(RuntimeError):
    """The daemon answered with a reply of the wrong type for the message sent."""


class ClientClosedError(ConnectionError):
    """The client was closed, or its reader failed (the failure is the `__cause__`)."""


class _End(enum.Enum):
    """Ends a stream once the client's own cancel was applied.

    A current daemon sends the request's `cancelled` terminal before `applied`, so the
    stream has ended on that entry already; an older one sends no terminal, and this marker
    is what ends the stream.
    """

    END = enum.auto()


_StreamItem: TypeAlias = OutputEntry | _End | BaseException
_LifecycleItem: TypeAlias = WireLifecycleEvent | BaseException


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


class EngineClient:
    """A connection to one daemon's control socket; build it with `await connect(...)`.

    Use it as `async with await EngineClient.connect(endpoint) as client:`, or call
    `close()`. Calls may run concurrently. Every call that waits on the daemon takes
    `timeout` (seconds, None = forever) and raises TimeoutError when it runs out.
    """

    def __init__(
        self, sock: zmq.asyncio.Socket, ctx: zmq.asyncio.Context, *, owns_ctx: bool
    ) -> None:
        # Private: `connect()` builds the socket and starts the reader.
        self._sock = sock
        self._ctx = ctx
        self._owns_ctx = owns_ctx
        self._decoder = ReplyDecoder()
        self._ids = itertools.count(1)
        self._pending: dict[int, asyncio.Future[DirectReply]] = {}
        # ids of calls that gave up (timeout, cancellation): their late replies are dropped
        # instead of being taken for the reply to a raw message.
        self._abandoned: set[int] = set()
        # send_raw() callers, oldest first: they take the direct replies no call claims.
        self._raw_waiters: deque[asyncio.Future[DirectReply]] = deque()
        self._streams: dict[str, asyncio.Queue[_StreamItem]] = {}
        self._handoffs: dict[str, asyncio.Queue[_LifecycleItem]] = {}
        self._lifecycle: asyncio.Queue[_LifecycleItem] = asyncio.Queue(LIFECYCLE_FEED_SIZE)
        self._on_load: Callable[[Load], None] | None = None
        self._failure: BaseException | None = None
        self._closed = False
        self._reader = asyncio.get_running_loop().create_task(
            self._read(), name="engine-client-reader"
        )

    @classmethod
    async def connect(
        cls,
        endpoint: str,
        *,
        ctx: zmq.asyncio.Context | None = None,
        identity: bytes | None = None,
    ) -> EngineClient:
        """Connect a DEALER to the daemon's control endpoint.

        Returns at once: ZeroMQ connects in the background and queues messages until then,
        so a daemon that is not there shows up as a TimeoutError on the first call
        (`hello()` is the usual first call).

        Args:
            endpoint: the daemon's `control_endpoint`.
            ctx: a context to share; when None the client makes one and terminates it on
                close.
            identity: the DEALER routing id the daemon sees; None lets ZeroMQ pick.
        """
        owns_ctx = ctx is None
        context = zmq.asyncio.Context() if ctx is None else ctx
        try:
            # NOTE: linger 0: every message that matters is followed by an awaited reply,
            # so what is still queued at close was abandoned, and close must not hang on a
            # daemon that went away.
            sock = make_socket(
                context,
                zmq.DEALER,
                endpoint,
                bind=False,
                sndhwm=_HWM,
                rcvhwm=_HWM,
                linger=0,
                routing_id=identity,
            )
        except BaseException:
            if owns_ctx:
                context.term()
            raise
        return cls(sock, context, owns_ctx=owns_ctx)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop the reader, fail what still waits with ClientClosedError, close the socket."""
        if self._closed:
            return
        self._closed = True
        self._reader.cancel()
        # A reader failure was logged and handed to every waiter when it happened; awaiting
        # here only collects it, so it is not reported twice.
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        if self._failure is None:
            self._fail_all(ClientClosedError("client closed"))
        self._sock.close()
        if self._owns_ctx:
            self._ctx.term()

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
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> Submitted:
        """Submit a request; read its outputs with `outputs(reply.request_id)`.

        With a `request_id` the output queue is registered before the message leaves, so no
        output can be missed; without one the daemon mints the id and outputs that beat the
        `submitted` reply are kept for `outputs()` all the same.
        """
        request = _request(token_ids, max_tokens, request_id, output_token_ids, dp_rank)
        msg = Submit(request=request, id=self._next_id())
        return await self._call_with_stream(msg, Submitted, request_id, timeout)

    async def outputs(
        self, request_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> AsyncIterator[OutputEntry]:
        """Yield the request's output entries until its finished one.

        Whoever cancels the request (this client, another one, the daemon), the last entry
        is a `cancelled` terminal; an older daemon sends none for this client's own cancel,
        and the stream then ends once that cancel was applied. `timeout` bounds the wait
        for each entry.
        """
        queue = self._stream_queue(request_id)
        while True:
            item = await self._get(queue, timeout)
            if isinstance(item, BaseException):
                raise item
            # Once the stream is over, forget its queue so finished requests do not pile up.
            if (item is _End.END or item.finished) and self._streams.get(request_id) is queue:
                del self._streams[request_id]
            if item is _End.END:
                return
            yield item
            if item.finished:
                return

    async def output_batches(
        self, request_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> AsyncIterator[list[OutputEntry]]:
        """Like `outputs`, but each item is every entry that had arrived by then, in order.

        A consumer slower than the engine (a relay such as the Dynamo worker) then pays its
        per-item cost once per backlog instead of once per pass, as vLLM's output collector
        merges the deltas its consumer has not taken yet.
        """
        queue = self._stream_queue(request_id)
        while True:
            first = await self._get(queue, timeout)
            batch: list[OutputEntry] = []
            end = False
            item: _StreamItem = first
            while True:
                if isinstance(item, BaseException):
                    if batch:
                        yield batch
                    raise item
                if item is _End.END:
                    end = True
                    break
                batch.append(item)
                if item.finished or queue.empty():
                    end = item.finished
                    break
                item = queue.get_nowait()
            if end and self._streams.get(request_id) is queue:
                del self._streams[request_id]
            if batch:
                yield batch
            if end:
                return

    async def stream(
        self,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        output_token_ids: Sequence[int] | None = None,
        dp_rank: int | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> AsyncIterator[OutputEntry]:
        """`submit` then `outputs`: the request's entries until its finished one."""
        submitted = await self.submit(
            token_ids,
            max_tokens,
            request_id=request_id,
            output_token_ids=output_token_ids,
            dp_rank=dp_rank,
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
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> Generation:
        """Submit and collect every output of the request."""
        submitted = await self.submit(
            token_ids,
            max_tokens,
            request_id=request_id,
            output_token_ids=output_token_ids,
            dp_rank=dp_rank,
            timeout=timeout,
        )
        return await self.collect(submitted, timeout=timeout)

    async def collect(
        self, submitted: Submitted, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Generation:
        """Gather the outputs of a submitted request (also a handoff prefill) into one value."""
        tokens: list[int] = []
        finish_reason: FinishReason | None = None
        cached_tokens: int | None = None
        handoff_delay_ms: float | None = None
        count = 0
        async for entry in self.outputs(submitted.request_id, timeout=timeout):
            count += 1
            tokens.extend(entry.token_ids)
            if entry.cached_tokens is not None and cached_tokens is None:
                cached_tokens = entry.cached_tokens
            if entry.handoff_delay_ms is not None:
                handoff_delay_ms = entry.handoff_delay_ms
            finish_reason = entry.finish_reason
        return Generation(
            request_id=submitted.request_id,
            dp_rank=submitted.dp_rank,
            token_ids=tokens,
            finish_reason=finish_reason,
            cached_tokens=cached_tokens,
            handoff_delay_ms=handoff_delay_ms,
            num_outputs=count,
        )

    async def cancel(
        self, request_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied | Noop:
        """Cancel a request, this client's or another's (a router may cancel any).

        `applied` when it was active: its owner's stream ends with a `cancelled` terminal,
        which comes before the `applied` when the owner is this client; no more output
        follows. `noop` when it was unknown or had already ended.
        """
        reply = await self._call_either(Cancel(request_id=request_id, id=self._next_id()), timeout)
        if isinstance(reply, Applied):
            queue = self._streams.pop(request_id, None)
            if queue is not None:
                queue.put_nowait(_End.END)
        return reply

    async def submit_handoff_prefill(
        self,
        handoff_id: str,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        output_token_ids: Sequence[int] | None = None,
        dp_rank: int | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> Submitted:
        """Prefill on this (source) worker; `source_held` arrives as a lifecycle event."""
        request = _request(token_ids, max_tokens, request_id, output_token_ids, dp_rank)
        msg = SubmitHandoffPrefill(handoff_id=handoff_id, request=request, id=self._next_id())
        return await self._call_with_stream(msg, Submitted, request_id, timeout)

    async def release_source(
        self, handoff_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied | Noop:
        """Free a held source; ends this client's lifecycle queue of the handoff."""
        msg = ReleaseSource(handoff_id=handoff_id, id=self._next_id())
        return await self._end_handoff(handoff_id, msg, timeout)

    async def cancel_source(
        self, handoff_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied | Noop:
        msg = CancelSource(handoff_id=handoff_id, id=self._next_id())
        return await self._end_handoff(handoff_id, msg, timeout)

    async def reserve_destination(
        self,
        handoff_id: str,
        token_ids: Sequence[int],
        max_tokens: int,
        *,
        request_id: str | None = None,
        output_token_ids: Sequence[int] | None = None,
        dp_rank: int | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
    ) -> DestinationAccepted:
        """Reserve KV on this (destination) worker; `destination_reserved` follows as a
        lifecycle event, and the request's outputs stream after `activate_destination`."""
        request = _request(token_ids, max_tokens, request_id, output_token_ids, dp_rank)
        msg = ReserveDestination(handoff_id=handoff_id, request=request, id=self._next_id())
        return await self._call_with_stream(msg, DestinationAccepted, request_id, timeout)

    async def activate_destination(
        self, handoff_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied | Noop:
        """Start decoding a reserved destination; ends this client's lifecycle queue of it."""
        msg = ActivateDestination(handoff_id=handoff_id, id=self._next_id())
        return await self._end_handoff(handoff_id, msg, timeout)

    async def cancel_destination(
        self, handoff_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied | Noop:
        msg = CancelDestination(handoff_id=handoff_id, id=self._next_id())
        return await self._end_handoff(handoff_id, msg, timeout)

    async def stats(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> StatsReply:
        return await self._call(Stats(id=self._next_id()), StatsReply, timeout)

    async def ping(self, *, timeout: float | None = DEFAULT_TIMEOUT) -> Pong:
        return await self._call(Ping(id=self._next_id()), Pong, timeout)

    async def reset_prefix_cache(
        self, dp_rank: int | None = None, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied:
        """Clear the prefix cache of `dp_rank`, or of every rank when None."""
        msg = ResetPrefixCache(dp_rank=dp_rank, id=self._next_id())
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
        self, worker_id: str, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> Applied:
        """Stamp every rank's forward-pass metrics with `worker_id` from now on."""
        return await self._call(
            SetFpmWorkerId(worker_id=worker_id, id=self._next_id()), Applied, timeout
        )

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

    # --- lifecycle events -----------------------------------------------------------------

    async def next_lifecycle(
        self, handoff_id: str | None = None, *, timeout: float | None = DEFAULT_TIMEOUT
    ) -> WireLifecycleEvent:
        """The next lifecycle event of `handoff_id`, or of any handoff when None.

        The two views are independent: an event is delivered once to its handoff's queue
        and once to the general feed (which keeps the newest LIFECYCLE_FEED_SIZE events).
        """
        if handoff_id is None:
            item = await self._get(self._lifecycle, timeout)
        else:
            queue = self._handoff_queue(handoff_id)
            item = await self._get(queue, timeout)
            if queue.empty() and self._handoffs.get(handoff_id) is queue:
                del self._handoffs[handoff_id]
        if isinstance(item, BaseException):
            raise item
        return item

    async def lifecycle_events(
        self, handoff_id: str | None = None, *, timeout: float | None = None
    ) -> AsyncIterator[WireLifecycleEvent]:
        """Yield lifecycle events (of one handoff, or all) until the client closes.

        `timeout` bounds the wait for each event (default: wait forever).
        """
        while True:
            try:
                yield await self.next_lifecycle(handoff_id, timeout=timeout)
            except ClientClosedError:
                return

    # --- internals ------------------------------------------------------------------------

    def _next_id(self) -> int:
        return next(self._ids)

    def _check_usable(self) -> None:
        if self._failure is not None:
            raise ClientClosedError("client reader failed") from self._failure
        if self._closed:
            raise ClientClosedError("client closed")

    async def _request(self, msg: ClientMessage, timeout: float | None) -> DirectReply:
        """Send `msg` (stamped with an int id) and wait for the reply echoing that id."""
        self._check_usable()
        message_id = msg.id
        assert isinstance(message_id, int), "the client stamps every message with an int id"
        future: asyncio.Future[DirectReply] = asyncio.get_running_loop().create_future()
        self._pending[message_id] = future
        try:
            async with asyncio.timeout(timeout):
                await self._sock.send_multipart((encode_message(msg),))
                reply = await future
        except BaseException:
            if self._pending.pop(message_id, None) is not None:
                self._abandoned.add(message_id)
            raise
        if isinstance(reply, ErrorReply):
            raise EngineError(reply.code, reply.message)
        return reply

    async def _call(self, msg: ClientMessage, expected: type[R], timeout: float | None) -> R:
        reply = await self._request(msg, timeout)
        if not isinstance(reply, expected):
            raise ProtocolError(f"expected `{_tag(expected)}` reply, got {reply!r}")
        return reply

    async def _call_either(self, msg: ClientMessage, timeout: float | None) -> Applied | Noop:
        reply = await self._request(msg, timeout)
        if not isinstance(reply, Applied | Noop):
            raise ProtocolError(f"expected `applied` or `noop` reply, got {reply!r}")
        return reply

    async def _call_with_stream(
        self, msg: ClientMessage, expected: type[R], request_id: str | None, timeout: float | None
    ) -> R:
        # Registered before sending so no output of the request can arrive unrouted.
        created = request_id is not None and request_id not in self._streams
        if request_id is not None:
            self._stream_queue(request_id)
        try:
            return await self._call(msg, expected, timeout)
        except BaseException:
            # Keep a queue that was already there: on `duplicate_request` it belongs to the
            # active request of the same id.
            if created and request_id is not None:
                queue = self._streams.get(request_id)
                if queue is not None and queue.empty():
                    del self._streams[request_id]
            raise

    async def _end_handoff(
        self, handoff_id: str, msg: ClientMessage, timeout: float | None
    ) -> Applied | Noop:
        reply = await self._call_either(msg, timeout)
        # After release/cancel/activate no lifecycle event can follow for this handoff.
        self._handoffs.pop(handoff_id, None)
        return reply

    def _stream_queue(self, request_id: str) -> asyncio.Queue[_StreamItem]:
        queue = self._streams.get(request_id)
        if queue is None:
            if self._failure is not None or self._closed:
                self._check_usable()
            queue = self._streams[request_id] = asyncio.Queue()
        return queue

    def _handoff_queue(self, handoff_id: str) -> asyncio.Queue[_LifecycleItem]:
        queue = self._handoffs.get(handoff_id)
        if queue is None:
            if self._failure is not None or self._closed:
                self._check_usable()
            queue = self._handoffs[handoff_id] = asyncio.Queue()
        return queue

    async def _get(self, queue: asyncio.Queue[_T], timeout: float | None) -> _T:
        if queue.empty():
            # Nothing will ever arrive on a closed client: fail now rather than time out.
            self._check_usable()
        async with asyncio.timeout(timeout):
            return await queue.get()

    # --- the reader -----------------------------------------------------------------------

    async def _read(self) -> None:
        try:
            while True:
                frames = await self._sock.recv_multipart(copy=False)
                # A DEALER reply is [body]; tolerate the REQ-style [b"", body] envelope too.
                if len(frames) == 2 and len(frames[0]) == 0:
                    frames = frames[1:]
                if len(frames) != 1:
                    log.warning("daemon message with unexpected frames", frames=len(frames))
                    continue
                try:
                    msg = self._decoder.decode(frames[0].buffer)
                except WireError as exc:
                    log.warning("undecodable daemon message", error=exc.message)
                    continue
                self._dispatch(msg)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            log.exception("engine client reader failed")
            self._failure = exc
            self._fail_all(exc)
            raise

    def _dispatch(self, msg: DaemonMessage) -> None:
        match msg:
            case Output():
                for entry in msg.outputs:
                    self._stream_queue(entry.request_id).put_nowait(entry)
            case Lifecycle():
                for event in msg.events:
                    self._handoff_queue(event.handoff_id).put_nowait(event)
                    _put_dropping_oldest(self._lifecycle, event)
            case Load():
                if self._on_load is not None:
                    self._on_load(msg)
            case DirectReply():
                self._resolve(msg)

    def _resolve(self, reply: DirectReply) -> None:
        message_id = reply.id
        if isinstance(message_id, int):
            future = self._pending.pop(message_id, None)
            if future is not None:
                if not future.done():
                    future.set_result(reply)
                return
            if message_id in self._abandoned:
                self._abandoned.discard(message_id)
                log.debug("late reply dropped", id=message_id)
                return
        while self._raw_waiters:
            waiter = self._raw_waiters.popleft()
            if not waiter.done():
                waiter.set_result(reply)
                return
        log.warning("unclaimed daemon reply", type=_tag(type(reply)), id=message_id)

    def _fail_all(self, exc: BaseException) -> None:
        """Hand `exc` to every waiting call and every stream and lifecycle consumer."""
        futures = [*self._pending.values(), *self._raw_waiters]
        self._pending.clear()
        self._raw_waiters.clear()
        for future in futures:
            if not future.done():
                future.set_exception(exc)
        for queue in self._streams.values():
            queue.put_nowait(exc)
        for handoff_queue in self._handoffs.values():
            handoff_queue.put_nowait(exc)
        _put_dropping_oldest(self._lifecycle, exc)


def _request(
    token_ids: Sequence[int],
    max_tokens: int,
    request_id: str | None,
    output_token_ids: Sequence[int] | None,
    dp_rank: int | None,
) -> WireRequest:
    # NOTE: no validation here: the daemon is the one judge of a request, and tests send
    # invalid ones through these methods on purpose.
    return WireRequest(
        request_id=request_id,
        token_ids=list(token_ids),
        max_tokens=max_tokens,
        output_token_ids=None if output_token_ids is None else list(output_token_ids),
        dp_rank=dp_rank,
    )


def _put_dropping_oldest(queue: asyncio.Queue[_LifecycleItem], item: _LifecycleItem) -> None:
    if queue.full():
        queue.get_nowait()
    queue.put_nowait(item)


def _tag(cls: type[DirectReply]) -> str:
    tag = cls.__struct_config__.tag
    return tag if isinstance(tag, str) else cls.__name__
