"""A minimal HTTP/1.1 server for Prometheus `/metrics` and a `/health` probe.

It runs on the daemon's own asyncio loop (`asyncio.start_server`) instead of a thread or a web
framework: the collector reads the cores' live state, which only the loop's thread may touch,
and two GET routes do not justify a dependency. A scrape renders synchronously on the loop
(a millisecond or so, at scrape rate); everything else (reading the request, writing the
response) awaits, so a slow or hostile client never stalls an engine pass.

Ranks in worker processes keep some figures in their own process (the replay and overflow
counters); the exposition (engined.server.ops.exposition, shared with the control protocol's
`metrics` command) fetches them first, within a bound, so that a worker that does not answer
delays a scrape but never fails it.

One request per connection (`Connection: close`), which Prometheus and every probe handle.
Anything that is not a well-formed request gets a 400 (or 431 for oversized headers, 408 when
it stalls), and no input can end the server.

With API keys the server asks for `Authorization: Bearer KEY` where vLLM's API server does
(`vllm/entrypoints/serve/middleware/authenticate.py` in 0.33): on every path that starts with
one of `GUARDED_PREFIXES`, whatever the method but OPTIONS, so a client probing `/v1/models`
meets vLLM's 401 and JSON body rather than a 404. `/health` and `/metrics` stay open as in
vLLM, unless `guard_metrics` (an engined extension) covers `/metrics`. The check reads the
request head only, before any scrape, so a refused request costs no rendering.
"""

from __future__ import annotations

import asyncio
import contextlib
import string
from collections.abc import Awaitable, Callable, Sequence
from typing import Literal
from urllib.parse import unquote

import structlog
from prometheus_client.registry import Collector

from engined.config.api_keys import BearerKeys
from engined.server.ops.exposition import Exposition

log = structlog.get_logger(__name__)

HealthState = Literal["starting", "serving", "draining"]

# Request line plus headers; Prometheus sends a few hundred bytes.
MAX_HEAD_BYTES = 16 * 1024
# A client gets this long to send its request and to take the response.
IO_TIMEOUT_S = 10.0


_REASONS = {
    200: "OK",
    400: "Bad Request",
    401: "Unauthorized",
    404: "Not Found",
    405: "Method Not Allowed",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    500: "Internal Server Error",
    503: "Service Unavailable",
}
_TEXT = "text/plain; charset=utf-8"
# vLLM's refusal, byte for byte (Starlette's compact JSON).
_UNAUTHORIZED: tuple[int, str, bytes, dict[str, str]] = (
    401,
    "application/json",
    b'{"error":"Unauthorized"}',
    {},
)
# RFC 9110 `tchar`: what a method or a header name may be made of.
_TOKEN_CHARS = frozenset("!#$%&'*+-.^_`|~" + string.ascii_letters + string.digits)


class _BadRequest(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class HttpServer:
    """`GET /metrics` renders `registry`; `GET /health` answers 200 only while serving.

    Args:
        registry: what `/metrics` exposes: the daemon's `Exposition`, or a registry (the
            daemon's dedicated CollectorRegistry) to expose after `before_scrape`.
        health: the daemon's state; "serving" is 200, "starting" and "draining" are 503 so
            routers stop sending before the daemon refuses requests.
        before_scrape: with a registry, awaited before `/metrics` renders (within a bound).
        api_keys: the bearer keys a guarded path needs one of; none guards nothing.
        guard_metrics: `/metrics` needs a key too.
    """

    def __init__(
        self,
        registry: Exposition | Collector,
        *,
        health: Callable[[], HealthState],
        before_scrape: Callable[[], Awaitable[None]] | None = None,
        api_keys: Sequence[str] = (),
        guard_metrics: bool = False,
    ) -> None:
        self._exposition = (
            registry if isinstance(registry, Exposition) else Exposition(registry, before_scrape)
        )
        self._health = health
        self._before_scrape = before_scrape
        self._keys = BearerKeys(tuple(api_keys), guard_metrics=guard_metrics)
        self._stale_scrapes = 0
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.Task[None]] = set()

    @property
    def port(self) -> int:
        """The bound port (useful when started on port 0)."""
        assert self._server is not None and self._server.sockets
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self, host: str, port: int) -> None:
        """Bind and listen; raises OSError (the daemon's start-up failure) if it cannot."""
        self._server = await asyncio.start_server(
            self._accept, host, port, limit=MAX_HEAD_BYTES, reuse_address=True
        )
        log.info(
            "http listening",
            host=host,
            port=self.port,
            routes=["/metrics", "/health"],
            api_keys=len(self._keys),
            metrics_need_key=self._keys.guard_metrics,
        )

    async def close(self) -> None:
        """Stop listening and drop open connections (Python 3.11's wait_closed does not)."""
        server, self._server = self._server, None
        if server is None:
            return
        server.close()
        for task in list(self._connections):
            task.cancel()
        for task in list(self._connections):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await server.wait_closed()

    # --- one connection -----------------------------------------------------------------

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        try:
            await self._serve_one(reader, writer)
        except (ConnectionError, TimeoutError):
            pass  # the client went away or stalled while we wrote; nothing to tell it
        except Exception:
            log.exception("http connection failed")
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(writer.wait_closed(), IO_TIMEOUT_S)

    async def _serve_one(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head_only = False
        try:
            method, path, headers = await self._read_request(reader)
            head_only = method == "HEAD"
            if not self._authorized(method, path, headers):
                status, content_type, body, extra = _UNAUTHORIZED
            else:
                if path == "/metrics" and method in ("GET", "HEAD"):
                    await self._exposition.refresh()
                status, content_type, body, extra = self._route(method, path, headers)
        except _BadRequest as exc:
            status, content_type, body, extra = exc.status, _TEXT, f"{exc}\n".encode(), {}
        except Exception:
            # A bug in a collector: say so to the scraper and in the log, and keep serving.
            log.exception("http request failed")
            status, content_type, body, extra = 500, _TEXT, b"internal error\n", {}
        lines = [
            f"HTTP/1.1 {status} {_REASONS[status]}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            "Connection: close",
            *(f"{name}: {value}" for name, value in extra.items()),
        ]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        writer.write(head if head_only else head + body)
        await asyncio.wait_for(writer.drain(), IO_TIMEOUT_S)

    @staticmethod
    async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, dict[str, str]]:
        """(method, path without query, lower-cased headers), or _BadRequest."""
        try:
            raw = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), IO_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            raise _BadRequest(431, "request head too large") from None
        except asyncio.IncompleteReadError:
            raise _BadRequest(400, "incomplete request") from None
        except TimeoutError:
            raise _BadRequest(408, "request not received in time") from None
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            raise _BadRequest(400, "request head is not ASCII") from None
        request_line, *header_lines = text[:-4].split("\r\n")
        parts = request_line.split(" ")
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            raise _BadRequest(400, "malformed request line")
        method, target, _version = parts
        if not method or not _TOKEN_CHARS.issuperset(method):
            raise _BadRequest(400, "malformed method")
        if not target.startswith("/"):
            raise _BadRequest(400, "malformed request target")
        headers: dict[str, str] = {}
        for line in header_lines:
            name, colon, value = line.partition(":")
            if not colon or not name or not _TOKEN_CHARS.issuperset(name):
                raise _BadRequest(400, "malformed header")
            # The first of a repeated header counts, as with Starlette's `Headers.get` in vLLM.
            headers.setdefault(name.lower(), value.strip())
        return method, target.partition("?")[0], headers

    def _authorized(self, method: str, path: str, headers: dict[str, str]) -> bool:
        return self._keys.authorized(method, unquote(path), headers.get("authorization", ""))

    def _route(
        self, method: str, path: str, headers: dict[str, str]
    ) -> tuple[int, str, bytes, dict[str, str]]:
        """(status, content type, body, extra headers) of a well-formed request."""
        if path not in ("/metrics", "/health"):
            return 404, _TEXT, b"not found\n", {}
        if method not in ("GET", "HEAD"):
            return 405, _TEXT, b"method not allowed\n", {"Allow": "GET, HEAD"}
        if path == "/health":
            state = self._health()
            if state == "serving":
                return 200, _TEXT, b"ok\n", {}
            return 503, _TEXT, f"{state}\n".encode(), {}
        content_type, body = self._exposition.render(headers.get("accept", ""))
        return 200, content_type, body, {}
