"""vLLM's `--sse-keep-alive-interval`: a streamed completion or chat that has sent nothing for
that many seconds (queued, prefilling, paused, between tokens) sends an SSE comment,
`: keep-alive`, so that a proxy's or tunnel's read timeout does not close it. SSE clients
skip comments (the `openai` package does). 0, vLLM's default, leaves a stream as it is.

One pending read of the stream is kept across waits, so a wait that times out never cancels
the stream in the middle of producing a chunk; closing the wrapper cancels that read and
closes the stream (engined.openai.http.http_messages.ClosingBody's contract).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
from collections.abc import AsyncIterator
from typing import Final

from engined.openai.http.http_messages import aclose_chunks

KEEP_ALIVE: Final = b": keep-alive\n\n"


def with_keep_alive(chunks: AsyncIterator[bytes], interval: float) -> AsyncIterator[bytes]:
    """`chunks`, with a keep-alive comment after each `interval` seconds without one; as they
    are when `interval` is not a positive finite number."""
    if not (interval > 0 and math.isfinite(interval)):
        return chunks
    return _KeepAlive(chunks, interval)


class _KeepAlive:
    def __init__(self, chunks: AsyncIterator[bytes], interval: float) -> None:
        self._chunks = chunks
        self._interval = interval
        self._pending: asyncio.Future[bytes] | None = None

    def __aiter__(self) -> _KeepAlive:
        return self

    async def __anext__(self) -> bytes:
        if self._pending is None:
            self._pending = asyncio.ensure_future(self._chunks.__anext__())
        done, _ = await asyncio.wait({self._pending}, timeout=self._interval)
        if not done:
            return KEEP_ALIVE
        pending, self._pending = self._pending, None
        # The stream's own end (StopAsyncIteration) or failure passes through.
        return pending.result()

    async def aclose(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.cancel()
            with contextlib.suppress(BaseException):
                await pending
        await aclose_chunks(self._chunks)
