"""A trivial app on a real `HttpServer` on loopback, and a raw HTTP/1.1 client to read it.

The app's routes answer with what the server handed them (`/echo`), stream what a test
feeds them chunk by chunk (`/stream`: nothing is yielded before the test says so, so a test
can prove each chunk left on its own), wait until cancelled (`/wait`) or released (`/hold`),
or fail (`/boom`).
The client parses responses byte by byte as sent, so the tests see framing (chunks,
`connection: close`, EOF) exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from engined.openai.http import (
    ErrorFactory,
    Handler,
    HttpLimits,
    HttpRequest,
    HttpResponse,
    HttpServer,
    StreamingResponse,
)


def error_factory(status: int, message: str) -> HttpResponse:
    """vLLM's error shape, as the serving layer will build it."""
    body = {"error": {"message": message, "type": "BadRequestError", "param": None, "code": status}}
    return HttpResponse(status, json.dumps(body).encode())


@dataclass
class Feed:
    """The chunks of one `/stream` response, released by the test one at a time."""

    chunks: asyncio.Queue[bytes | None] = field(default_factory=asyncio.Queue)
    started: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)
    ended_by: str = ""


class App:
    def __init__(self) -> None:
        self.requests: list[HttpRequest] = []
        self.in_flight = 0
        self.most_in_flight = 0
        self.feeds: list[Feed] = []
        self.waiting = asyncio.Event()
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        self.requests.append(request)
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            return await self._route(request)
        finally:
            self.in_flight -= 1

    async def _route(self, request: HttpRequest) -> HttpResponse | StreamingResponse:
        if request.path == "/stream":
            feed = Feed()
            self.feeds.append(feed)
            return StreamingResponse(200, self._stream(feed), headers=(("x-stream", "1"),))
        if request.path == "/wait":
            self.waiting.set()
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
        if request.path == "/hold":
            self.waiting.set()
            await self.release.wait()
        if request.path == "/boom":
            raise RuntimeError("the handler failed")
        if request.path == "/bad-header":
            return HttpResponse(200, b"{}", headers=(("x-split", "a\r\nx-injected: 1"),))
        echo = {
            "method": request.method,
            "path": request.path,
            "query": request.query,
            "headers": dict(request.headers),
            "body": request.body.decode("latin-1"),
            "peer": request.peer,
        }
        return HttpResponse(200, json.dumps(echo).encode(), headers=(("x-echo", "yes"),))

    async def _stream(self, feed: Feed) -> AsyncIterator[bytes]:
        feed.started.set()
        try:
            while (chunk := await feed.chunks.get()) is not None:
                yield chunk
            feed.ended_by = "exhausted"
        except GeneratorExit:
            feed.ended_by = "aclose"
            raise
        except asyncio.CancelledError:
            feed.ended_by = "cancelled"
            raise
        finally:
            feed.closed.set()


class Chunks:
    """A stream that is not a generator, so only an explicit aclose() reaches it.

    The test puts what it yields: bytes, None (the end) or an exception (raised there).
    Its aclose() waits for the test, as the serving layer's waits for the daemon to take the
    cancel, so a test sees whether the server lets it finish.
    """

    def __init__(self) -> None:
        self.queue: asyncio.Queue[bytes | Exception | None] = asyncio.Queue()
        self.aclose_started = asyncio.Event()
        self.aclose_may_end = asyncio.Event()
        self.aclosed = 0

    def __aiter__(self) -> Chunks:
        return self

    async def __anext__(self) -> bytes:
        item = await self.queue.get()
        if item is None:
            raise StopAsyncIteration
        if isinstance(item, Exception):
            raise item
        return item

    async def aclose(self) -> None:
        self.aclose_started.set()
        await self.aclose_may_end.wait()
        self.aclosed += 1


@contextlib.asynccontextmanager
async def serving(
    app: App | None = None,
    limits: HttpLimits | None = None,
    *,
    handler: Handler | None = None,
    factory: ErrorFactory = error_factory,
) -> AsyncIterator[tuple[HttpServer, int]]:
    """An HttpServer on a loopback socket bound here (as the daemon binds it), shut at exit."""
    sock = socket.create_server(("127.0.0.1", 0), backlog=4096)
    server = HttpServer(handler or app or App(), factory, limits or HttpLimits())
    task = asyncio.create_task(server.serve(sock))
    try:
        yield server, sock.getsockname()[1]
    finally:
        await server.shutdown(0)
        await task
        sock.close()


@dataclass
class Response:
    status: int
    reason: str
    headers: dict[str, str]
    body: bytes
    chunks: list[bytes] | None = None

    def json(self) -> dict[str, object]:
        value = json.loads(self.body)
        assert isinstance(value, dict)
        return value


async def connect(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def get(path: str, *headers: str, method: str = "GET", version: str = "1.1") -> bytes:
    lines = [f"{method} {path} HTTP/{version}", "Host: localhost", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def post(path: str, body: bytes, *headers: str) -> bytes:
    return get(path, f"Content-Length: {len(body)}", *headers, method="POST") + body


async def read_head(reader: asyncio.StreamReader) -> tuple[int, str, dict[str, str]]:
    raw = await reader.readuntil(b"\r\n\r\n")
    status_line, *lines = raw[:-4].decode("latin-1").split("\r\n")
    version, status, reason = status_line.split(" ", 2)
    assert version == "HTTP/1.1"
    headers: dict[str, str] = {}
    for line in lines:
        name, _, value = line.partition(":")
        assert name.lower() not in headers, f"repeated header {name}"
        headers[name.lower()] = value.strip()
    return int(status), reason, headers


async def read_chunk(reader: asyncio.StreamReader) -> bytes:
    """One chunk of a chunked body (b"" for the last one, whose CRLF it consumes too)."""
    size = int((await reader.readuntil(b"\r\n"))[:-2], 16)
    data = await reader.readexactly(size + 2)
    assert data.endswith(b"\r\n")
    return data[:-2]


async def read_response(reader: asyncio.StreamReader, *, head_only: bool = False) -> Response:
    status, reason, headers = await read_head(reader)
    if head_only:
        return Response(status, reason, headers, b"")
    if headers.get("transfer-encoding") == "chunked":
        chunks = []
        while chunk := await read_chunk(reader):
            chunks.append(chunk)
        return Response(status, reason, headers, b"".join(chunks), chunks)
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
        return Response(status, reason, headers, body)
    return Response(status, reason, headers, await reader.read())


async def exchange(port: int, data: bytes) -> tuple[Response, bytes]:
    """One connection: send `data`, read a response, then all that follows until EOF."""
    reader, writer = await connect(port)
    try:
        writer.write(data)
        response = await read_response(reader)
        return response, await reader.read()
    finally:
        writer.close()
