"""vLLM's `--sse-keep-alive-interval`: an idle stream sends `: keep-alive` comments.

The wrapper is tested on a stream a test releases chunk by chunk (`http_support.Chunks`; a
tiny interval, so the first read times out while the stream has nothing); then once against
a real `engined serve` whose generation is paused (`keep`), so a stream accepted meanwhile
can only be idle: it gets a comment before its first event, and its whole answer after the
resume.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path

from engined.openai.http.http_messages import aclose_chunks
from engined.openai.sse_keep_alive import KEEP_ALIVE, with_keep_alive
from tests.openai.api_harness import start_api
from tests.openai.http_support import Chunks, connect, post, read_chunk, read_head
from tests.support import run


def test_no_interval_leaves_the_stream_as_it_is() -> None:
    stream = Chunks()
    assert with_keep_alive(stream, 0) is stream
    assert with_keep_alive(stream, float("inf")) is stream


def test_an_idle_stream_gets_comments_and_then_its_chunks() -> None:
    async def scenario() -> list[bytes]:
        stream = Chunks()
        wrapped: AsyncIterator[bytes] = with_keep_alive(stream, 0.01)
        got = [await anext(wrapped)]
        stream.queue.put_nowait(b"data: 1\n\n")
        got.append(await anext(wrapped))
        stream.queue.put_nowait(None)
        got.extend([chunk async for chunk in wrapped])
        return got

    assert run(scenario()) == [KEEP_ALIVE, b"data: 1\n\n"]


def test_closing_it_cancels_the_pending_read_and_closes_the_stream() -> None:
    async def scenario() -> int:
        stream = Chunks()
        stream.aclose_may_end.set()
        wrapped = with_keep_alive(stream, 0.01)
        assert await anext(wrapped) == KEEP_ALIVE
        await aclose_chunks(wrapped)
        return stream.aclosed

    assert run(scenario()) == 1


def test_a_stream_queued_behind_a_pause_is_kept_alive(tmp_path: Path) -> None:
    flags = ("--speedup-ratio", "0", "--sse-keep-alive-interval", "1")

    async def scenario(port: int) -> list[bytes]:
        async def call(path: str) -> int:
            reader, writer = await connect(port)
            writer.write(post(path, b""))
            status = (await read_head(reader))[0]
            writer.close()
            return status

        assert await call("/pause?mode=keep") == 200
        reader, writer = await connect(port)
        body = json.dumps(
            {
                "model": "engined",
                "prompt": [1, 2],
                "max_tokens": 3,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
        )
        writer.write(post("/v1/completions", body.encode(), "Content-Type: application/json"))
        assert (await read_head(reader))[0] == 200
        chunks = [await read_chunk(reader)]
        assert await call("/resume") == 200
        while chunk := await read_chunk(reader):
            chunks.append(chunk)
        writer.close()
        return chunks

    with start_api(tmp_path, *flags, env={"VLLM_SERVER_DEV_MODE": "1"}) as api:
        chunks = run(scenario(api.port))
    assert chunks[0] == KEEP_ALIVE
    # After the resume: the tokens (in as many events as the API server's reads merged them
    # into), the usage chunk, [DONE].
    *tokens, usage, done = [c for c in chunks if c != KEEP_ALIVE]
    assert done == b"data: [DONE]\n\n" and tokens, chunks
    assert json.loads(usage.removeprefix(b"data: "))["usage"]["completion_tokens"] == 3
