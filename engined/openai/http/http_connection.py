"""One HTTP/1.1 connection of the API server: one request at a time, answered in order.

A connection is an asyncio `Protocol`, not a stream reader, so that bytes reach the C parser
without a copy through a buffer object and a streamed chunk reaches the socket with one
`transport.write`. It parses only while no request is in flight: bytes a pipelining client
sends meanwhile wait unparsed (reading pauses past 64 KiB of them) and are parsed, in order,
once the response is written, so one handler runs per connection and every deadline runs
only while the server waits for the client. Reading goes on during a handler and a stream,
so a client that leaves is seen at once: its handler task is cancelled, its stream's
iterator aclose()d. The deadlines of a connection waiting for its client are
`engined.openai.http.wait_deadline`'.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Literal, Protocol, cast

import structlog

import engined.openai.http.wire as wire
from engined.openai.http.http_messages import (
    ErrorFactory,
    Handler,
    HttpResponse,
    StreamingResponse,
    aclose_chunks,
)
from engined.openai.http.limits import HttpLimits
from engined.openai.http.parsing import Item, RequestReader
from engined.openai.http.wait_deadline import WaitDeadline

log = structlog.get_logger(__name__)

_BACKLOG_BYTES = 64 * 1024
# How long a refused client has to read its error before the connection is cut.
LINGER_S = 1.0
Admission = Literal["serve", "refuse", "drop"]


class ConnectionOwner(Protocol):
    handler: Handler
    error_factory: ErrorFactory
    limits: HttpLimits

    @property
    def shutting_down(self) -> bool: ...

    def admit(self, connection: HttpConnection) -> Admission: ...

    def connection_closed(self, connection: HttpConnection) -> None: ...


class HttpConnection(asyncio.Protocol):
    def __init__(self, owner: ConnectionOwner) -> None:
        self._owner = owner
        self._limits = owner.limits
        self._loop = asyncio.get_running_loop()
        self._transport: asyncio.Transport | None = None
        self._reader = RequestReader(owner.limits, self._loop.time)
        self._peer = ""
        self._backlog = bytearray()
        self._task: asyncio.Task[None] | None = None
        self._unwinding = False
        self._deadline = WaitDeadline(self._loop, owner.limits, self._reader, self._expired)
        self._cut: asyncio.TimerHandle | None = None
        self._reading_paused = False
        self._write_paused = False
        self._drain_waiter: asyncio.Future[None] | None = None
        self._closing = False
        self.closed = False

    # --- asyncio callbacks ----------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple) and len(peer) >= 2:
            self._peer = self._reader.peer = f"{peer[0]}:{peer[1]}"
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        admission = self._owner.admit(self)
        if admission == "serve":
            self._arm()
        elif admission == "refuse":
            self._reader.phase = "dead"
            self._send(
                self._error_bytes(503, "Too many connections to the server; try again later")
            )
            self._close_after_write(linger=True)
        else:
            self._reader.phase = "dead"
            self._closing = True
            self._transport.abort()

    def data_received(self, data: bytes) -> None:
        if self._reader.phase == "dead":
            return
        try:
            if self._task is not None or self._reader.items:
                self._backlog += data
                if len(self._backlog) >= _BACKLOG_BYTES:
                    self._pause_reading()
            elif self._backlog:
                self._backlog += data
                self._feed_backlog()
            else:
                self._feed(memoryview(data))
        except Exception:
            log.exception("http connection failed", peer=self._peer)
            self.abort()

    def eof_received(self) -> bool:
        """The peer's FIN ends the connection, as with uvicorn: a half-closed client is gone."""
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._reader.phase = "dead"
        self._deadline.stop()
        if self._cut is not None:
            self._cut.cancel()
        self._cut = None
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_exception(ConnectionResetError("client went away"))
        if self._task is not None and not self._unwinding:
            self._task.cancel()
        self._owner.connection_closed(self)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        if self._drain_waiter is not None and not self._drain_waiter.done():
            self._drain_waiter.set_result(None)

    # --- the server's controls ------------------------------------------------------------

    @property
    def task(self) -> asyncio.Task[None] | None:
        return self._task

    @property
    def unparsed_bytes(self) -> int:
        return len(self._backlog)

    def close_if_idle(self) -> None:
        """At shutdown: a connection with no request in flight goes at once."""
        if self._task is None and not self._reader.items:
            self._close_after_write()

    def abort(self) -> None:
        """Cut the connection and cancel what runs for it (a stream's finally aclose()s it).

        Called from the request's own task (a stalled reader, a failed stream), it does not
        cancel that task, whose aclose() of the stream must be able to await.
        """
        task = self._task
        if task is not None and not self._unwinding and task is not asyncio.current_task():
            task.cancel()
        self._reader.phase = "dead"
        self._closing = True
        if self._transport is not None:
            self._transport.abort()

    # --- parsing ----------------------------------------------------------------------------

    def _feed(self, data: memoryview) -> None:
        """Parse while idle; what follows a complete request waits in the backlog."""
        consumed = self._reader.feed(data)
        if self._reader.phase == "dead":
            self._backlog.clear()
            self._resume_reading()  # what comes is dropped; a client leaving is still seen
        elif consumed < len(data):
            self._backlog += data[consumed:]
        if len(self._backlog) < _BACKLOG_BYTES:
            self._resume_reading()
        self._send_continue()
        if self._reader.items and self._task is None:
            self._deadline.cancel()
            self._task = self._loop.create_task(self._run())
        elif self._task is None:
            self._arm()

    def _feed_backlog(self) -> None:
        if self._backlog and self._reader.phase != "dead":
            data = bytes(self._backlog)
            self._backlog.clear()
            self._feed(memoryview(data))
        else:
            self._send_continue()

    def _send_continue(self) -> None:
        """`100 Continue` once the body is wanted: now, unless a response is still due."""
        if self._reader.continue_due and not self._reader.items:
            self._reader.continue_due = False
            self._send(wire.CONTINUE)

    # --- answering ----------------------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while self._reader.items and not self.closed:
                item = self._reader.items.popleft()
                if not await self._answer(item) or self._owner.shutting_down:
                    self._close_after_write(linger=item.refusal is not None)
                    return
                if not self._reader.items:
                    self._feed_backlog()
        except (ConnectionError, asyncio.CancelledError):
            pass  # the client left (or shutdown's grace ended): nothing to tell it
        except Exception:
            log.exception("http connection failed", peer=self._peer)
            self.abort()
        finally:
            self._task = None
            if not self.closed and self._reader.phase in ("head", "body"):
                self._reader.phase_since = self._loop.time()
            self._arm()

    async def _answer(self, item: Item) -> bool:
        """Write the answer to `item`; whether the connection may serve another request."""
        if item.request is None:
            assert item.refusal is not None
            log.debug("http request refused", status=item.refusal.status, peer=self._peer)
            self._write(self._error_bytes(item.refusal.status, item.refusal.message))
            return False
        try:
            response = await self._owner.handler(item.request)
            if not isinstance(response, (HttpResponse, StreamingResponse)):
                raise TypeError(f"handler returned {type(response).__name__}")
        except Exception:
            log.exception("http handler failed", path=item.request.path, peer=self._peer)
            response = self._error(500, "Internal Server Error")
        close = not item.keep_alive or self._owner.shutting_down
        streaming = isinstance(response, StreamingResponse)
        # An HTTP/1.0 client cannot take chunks: its stream's end is the connection's.
        close = close or (streaming and item.http10)
        try:
            head = wire.head(
                response.status,
                response.content_type,
                response.headers,
                length=None if isinstance(response, StreamingResponse) else len(response.body),
                close=close,
                keep_alive_10=item.http10,
            )
        except ValueError:
            log.exception("http handler's response is malformed", path=item.request.path)
            if isinstance(response, StreamingResponse):
                await _aclose(response.chunks)
            self._write(self._error_bytes(500, "Internal Server Error", close))
            await self._drain()
            return not close
        head_only = item.request.method == "HEAD"
        if isinstance(response, StreamingResponse):
            return await self._stream(response.chunks, head, head_only, item.http10, close)
        self._write(head if head_only else head + response.body)
        await self._drain()
        return not close

    async def _stream(
        self, chunks: AsyncIterator[bytes], head: bytes, head_only: bool, http10: bool, close: bool
    ) -> bool:
        """Each chunk out as it comes, then `chunks` aclose()d, however the stream ended."""
        try:
            self._write(head)
            if head_only:
                return not close
            async for data in chunks:
                if data:
                    self._write(data if http10 else wire.chunk(data))
                    if self._write_paused:
                        await self._drain()
            if not http10:
                self._write(wire.LAST_CHUNK)
            await self._drain()
            return not close
        except (ConnectionError, asyncio.CancelledError):
            raise
        except Exception:
            # The body is cut short: the client sees no last chunk (or an early close) and
            # knows the response is incomplete; nothing else could tell it after the head.
            log.exception("http stream failed", peer=self._peer)
            self.abort()
            return False
        finally:
            self._unwinding = True
            try:
                await _aclose(chunks)
            finally:
                self._unwinding = False

    # --- writing ------------------------------------------------------------------------------

    def _write(self, data: bytes) -> None:
        if not self._send(data):
            raise ConnectionResetError("connection closed")

    def _send(self, data: bytes) -> bool:
        if self.closed or self._closing or self._transport is None:
            return False
        self._transport.write(data)
        return True

    async def _drain(self) -> None:
        """Wait for the socket to take the response (a client that never reads is cut)."""
        if not self._write_paused:
            return
        self._drain_waiter = self._loop.create_future()
        try:
            await asyncio.wait_for(self._drain_waiter, self._limits.write_timeout_s)
        except TimeoutError:
            log.debug("http client stopped reading", peer=self._peer)
            self.abort()
            raise ConnectionAbortedError("client stopped reading") from None
        finally:
            self._drain_waiter = None

    def _error(self, status: int, message: str) -> HttpResponse:
        return wire.error_response(self._owner.error_factory, status, message)

    def _error_bytes(self, status: int, message: str, close: bool = True) -> bytes:
        return wire.error_bytes(self._owner.error_factory, status, message, close)

    def _close_after_write(self, *, linger: bool = False) -> None:
        """Close once what is written is sent; a client that reads none of it is cut.

        `linger`: a refused client may still be sending (a body we will not read); closing
        with its bytes unread would reset the connection and could destroy our answer before
        it reads it. So we half-close, drop what comes, and close at its EOF or after
        `LINGER_S`, as nginx's lingering close does.
        """
        self._reader.phase = "dead"
        if self._closing or self.closed or self._transport is None:
            return
        transport = self._transport
        self._deadline.cancel()
        if linger and transport.can_write_eof():
            transport.write_eof()
            self._resume_reading()
            self._closing = True
            self._cut = self._loop.call_later(LINGER_S, transport.abort)
            return
        self._closing = True
        transport.close()
        if transport.get_write_buffer_size():
            self._cut = self._loop.call_later(self._limits.write_timeout_s, transport.abort)

    def _pause_reading(self) -> None:
        if not self._reading_paused and self._transport is not None and not self._closing:
            self._reading_paused = True
            self._transport.pause_reading()

    def _resume_reading(self) -> None:
        if self._reading_paused and self._transport is not None and not self.closed:
            self._reading_paused = False
            self._transport.resume_reading()

    # --- deadlines ----------------------------------------------------------------------------

    def _arm(self) -> None:
        """A deadline only while the server waits for the client (`WaitDeadline`)."""
        if self._task is not None or self._reader.items or self._closing or self.closed:
            self._deadline.cancel()
        else:
            self._deadline.arm()

    def _expired(self) -> None:
        if self._task is not None or self._reader.items or self._closing or self.closed:
            return
        phase = self._reader.phase
        if phase in ("head", "body"):
            timeout = (
                self._limits.head_timeout_s if phase == "head" else self._limits.body_timeout_s
            )
            what = "header" if phase == "head" else "body"
            log.debug("http request too slow", part=what, peer=self._peer)
            self._send(self._error_bytes(408, f"Request {what} not received within {timeout} s"))
            self._close_after_write(linger=True)
        else:
            self._close_after_write()


async def _aclose(chunks: object) -> None:
    """Close a response's chunks; a failure to is logged, never the connection's."""
    try:
        await aclose_chunks(chunks)
    except Exception:
        log.exception("closing a response stream failed")
