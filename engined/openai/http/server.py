"""The API server's HTTP/1.1 server: a listening socket it is given, its connections, shutdown.

Why its own server on httptools rather than uvicorn, granian or aiohttp: the README's
"Choosing the HTTP stack" measured them on this workload; a plain asyncio `Protocol` on
llhttp cost the least CPU per request and was second only to granian's RSGI per streamed
event, and every bound of `HttpLimits` (none of which uvicorn has for a head's time, a body's
size or a stalled reader) is ours to enforce and test.

The daemon binds the socket (vLLM's `--host`/`--port`) and hands its descriptor to each API
server process; `serve` accepts on it until `shutdown`. Past `max_connections` a new
connection is answered 503 at once (vLLM's JSON error, from the app's error factory) rather
than left in the kernel's queue, so a client knows at once and is not left to time out. A
connection that has no request in flight costs one timer and no CPU: the idle ones are
closed by their keep-alive deadline, never polled.
"""

from __future__ import annotations

import asyncio
import resource
import socket

import structlog

from engined.openai.http.http_connection import Admission, HttpConnection
from engined.openai.http.http_messages import ErrorFactory, Handler
from engined.openai.http.limits import HttpLimits

log = structlog.get_logger(__name__)

# uvicorn's (so vLLM's) listen backlog.
BACKLOG = 2048
# Descriptors kept for everything else of the process (the control client, logs, imports).
RESERVED_FDS = 64
# Refused connections lingering at once for their 503 to be read; past it they are just cut.
MAX_REFUSING = 64
# How long shutdown waits, after its grace, for cancelled streams to finish aclose().
ACLOSE_WAIT_S = 5.0


class HttpServer:
    """`HttpServer(handler, error_factory, limits)`; `await serve(sock)`; `await shutdown(s)`."""

    def __init__(self, handler: Handler, error_factory: ErrorFactory, limits: HttpLimits) -> None:
        self.handler = handler
        self.error_factory = error_factory
        self.limits = limits
        self._max_connections = limits.max_connections
        self._connections: set[HttpConnection] = set()
        self._refusing: set[HttpConnection] = set()
        self._server: asyncio.Server | None = None
        self._shutting_down = False
        self._all_closed = asyncio.Event()
        self._done = asyncio.Event()

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down

    @property
    def connections(self) -> int:
        """Connections being served (refused ones not counted)."""
        return len(self._connections)

    @property
    def unparsed_bytes(self) -> int:
        """Bytes received and not parsed yet: pipelined requests waiting for their turn."""
        return sum(connection.unparsed_bytes for connection in self._connections)

    @property
    def max_connections(self) -> int:
        """`limits.max_connections`, within what the descriptor limit lets the process hold."""
        return self._max_connections

    async def serve(self, sock: socket.socket) -> None:
        """Accept on `sock` (bound and listening) until `shutdown` has finished."""
        if self._server is not None or self._shutting_down:
            raise RuntimeError("HttpServer.serve runs once")
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and soft - RESERVED_FDS < self._max_connections:
            self._max_connections = max(1, soft - RESERVED_FDS)
            log.warning(
                "http connections capped by the descriptor limit",
                max_connections=self._max_connections,
                asked=self.limits.max_connections,
                nofile=soft,
            )
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(
            lambda: HttpConnection(self), sock=sock, backlog=BACKLOG
        )
        log.info("http serving", address=_address(sock), max_connections=self._max_connections)
        await self._done.wait()

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting; let requests in flight finish for up to `grace_s`; then close all.

        Idle connections close at once, busy ones after their response (with
        `connection: close`); what still runs after the grace is cancelled, its stream
        aclose()d, its connection cut.
        """
        if self._shutting_down:
            await self._done.wait()
            return
        self._shutting_down = True
        if self._server is not None:
            self._server.close()
        for connection in list(self._connections | self._refusing):
            connection.close_if_idle()
        self._check_all_closed()
        if not self._all_closed.is_set():
            try:
                await asyncio.wait_for(self._all_closed.wait(), max(grace_s, 0.0))
            except TimeoutError:
                log.warning("http shutdown grace over", cut=len(self._connections))
        tasks = []
        for connection in list(self._connections | self._refusing):
            if connection.task is not None:
                tasks.append(connection.task)
            connection.abort()
        if tasks:
            await asyncio.wait(tasks, timeout=ACLOSE_WAIT_S)
        if self._server is not None:
            await self._server.wait_closed()
        self._done.set()

    # --- ConnectionOwner ----------------------------------------------------------------------

    def admit(self, connection: HttpConnection) -> Admission:
        if self._shutting_down:
            return "drop"
        if len(self._connections) < self._max_connections:
            self._connections.add(connection)
            return "serve"
        if len(self._refusing) < MAX_REFUSING:
            self._refusing.add(connection)
            return "refuse"
        return "drop"

    def connection_closed(self, connection: HttpConnection) -> None:
        self._connections.discard(connection)
        self._refusing.discard(connection)
        self._check_all_closed()

    def _check_all_closed(self) -> None:
        if self._shutting_down and not self._connections and not self._refusing:
            self._all_closed.set()


def _address(sock: socket.socket) -> str:
    try:
        name = sock.getsockname()
    except OSError:
        return ""
    return f"{name[0]}:{name[1]}" if isinstance(name, tuple) else str(name)
