"""What a handler of the API server sees and returns (issue 22's shared design, exactly).

The HTTP layer knows nothing of OpenAI: it hands a fully read request to one coroutine and
writes what it returns. Its own refusals go through the app's `ErrorFactory`, so that a client
meets vLLM's JSON error shape whether the app or the server said no.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpRequest:
    method: str  # upper-case as sent ("GET", "POST")
    path: str  # percent-decoded path, no query string
    query: str  # raw query string ("" when none)
    headers: Mapping[str, str]  # names lower-cased; repeated headers joined with ", "
    body: bytes
    peer: str  # "host:port" of the client


@dataclass(frozen=True, slots=True)
class HttpResponse:
    status: int
    body: bytes = b""
    content_type: str = "application/json"  # "": no content-type header
    headers: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True, slots=True)
class StreamingResponse:
    status: int
    chunks: AsyncIterator[bytes]  # each chunk is written and flushed as soon as it is yielded
    content_type: str = "text/event-stream; charset=utf-8"
    headers: tuple[tuple[str, str], ...] = ()


async def aclose_chunks(chunks: object) -> None:
    """`chunks.aclose()` if it has one: how whoever made a streamed body learns it is over."""
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()


class ClosingBody:
    """Chunks whose `aclose` also runs `on_close`, once, however the stream ended: the HTTP
    side aclose()s every streamed body, but a generator that never started (the client left
    before the head was written) runs no `finally`, so what must end with the stream (its
    engine requests, a count of requests in flight) is tied to `aclose` instead."""

    def __init__(
        self, chunks: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]]
    ) -> None:
        self._chunks = chunks
        self._on_close: Callable[[], Awaitable[None]] | None = on_close

    def __aiter__(self) -> ClosingBody:
        return self

    async def __anext__(self) -> bytes:
        return await self._chunks.__anext__()

    async def aclose(self) -> None:
        try:
            await aclose_chunks(self._chunks)
        finally:
            on_close, self._on_close = self._on_close, None
            if on_close is not None:
                await on_close()


Handler = Callable[[HttpRequest], Awaitable[HttpResponse | StreamingResponse]]
# The server's own refusals (malformed HTTP, too large, too slow, too many connections) are
# built by the app, so they carry vLLM's JSON error shape: ErrorFactory(status, message).
ErrorFactory = Callable[[int, str], HttpResponse]
