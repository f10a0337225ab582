"""The API server's HTTP/1.1 server, on real loopback sockets: what a well-behaved client gets.

Keep-alive and HTTP/1.0, pipelining answered in order with one request in flight,
`Expect: 100-continue`, chunked bodies in and out, a stream flushed chunk by chunk (the client
reads each chunk before the handler is allowed to yield the next), a client leaving mid-stream
or mid-handler, handler failures, and shutdown with a stream in flight. The bounds and the
malformed inputs are in test_http_limits.py.
"""

from __future__ import annotations

import asyncio

import pytest

from engined.openai.http import HttpRequest, HttpResponse, StreamingResponse
from tests.openai.http_support import (
    App,
    Chunks,
    connect,
    error_factory,
    exchange,
    get,
    post,
    read_chunk,
    read_head,
    read_response,
    serving,
)
from tests.support import run, until


def test_keep_alive_serves_requests_in_turn_with_what_the_client_sent() -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app) as (_, port):
            reader, writer = await connect(port)
            host, client_port = writer.get_extra_info("sockname")
            writer.write(get("/v1/a%20b?x=1&y=%20", "X-Twice: one", "x-twice: two"))
            first = await read_response(reader)
            writer.write(post("/v1/completions", b'{"prompt": "hi"}'))
            second = await read_response(reader)
            writer.close()
        assert first.status == 200
        assert first.headers["content-type"] == "application/json"
        assert first.headers["x-echo"] == "yes"
        assert "connection" not in first.headers
        assert first.json() == {
            "method": "GET",
            "path": "/v1/a b",
            "query": "x=1&y=%20",
            "headers": {"host": "localhost", "x-twice": "one, two"},
            "body": "",
            "peer": f"{host}:{client_port}",
        }
        assert second.json()["method"] == "POST"
        assert second.json()["body"] == '{"prompt": "hi"}'
        assert second.json()["headers"] == {"host": "localhost", "content-length": "16"}
        assert [request.path for request in app.requests] == ["/v1/a b", "/v1/completions"]

    run(scenario())


def test_pipelined_requests_are_answered_in_order_one_at_a_time() -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app) as (_, port):
            reader, writer = await connect(port)
            writer.write(
                get("/1")
                + post("/2", b"two")
                + get("/3", "Transfer-Encoding: chunked", method="POST")
                + b"3\r\nthr\r\n2\r\nee\r\n0\r\n\r\n"
                + get("/4", "Connection: close")
                + get("/5")
            )
            responses = [await read_response(reader) for _ in range(4)]
            rest = await reader.read()
            writer.close()
        assert [r.json()["path"] for r in responses] == ["/1", "/2", "/3", "/4"]
        assert [r.json()["body"] for r in responses] == ["", "two", "three", ""]
        assert [r.headers.get("connection") for r in responses] == [None, None, None, "close"]
        assert rest == b""
        assert app.most_in_flight == 1
        assert len(app.requests) == 4

    run(scenario())


def test_http_1_0_closes_unless_kept_alive_and_streams_up_to_the_close() -> None:
    async def scenario() -> None:
        async with serving() as (_, port):
            reader, writer = await connect(port)
            writer.write(get("/a", "Connection: keep-alive", version="1.0"))
            kept = await read_response(reader)
            writer.write(get("/b", version="1.0"))
            closed = await read_response(reader)
            rest = await reader.read()
            writer.close()

        assert kept.headers["connection"] == "keep-alive"
        assert kept.json()["path"] == "/a"
        assert closed.headers["connection"] == "close"
        assert closed.json()["path"] == "/b"
        assert rest == b""

    run(scenario())


def test_http_1_0_stream_is_delimited_by_the_close() -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app) as (_, port):
            reader, writer = await connect(port)
            writer.write(get("/stream", version="1.0"))
            status, _, headers = await read_head(reader)
            feed = app.feeds[0]
            await feed.chunks.put(b"data: 1\n\n")
            assert await reader.readexactly(9) == b"data: 1\n\n"
            await feed.chunks.put(b"data: [DONE]\n\n")
            await feed.chunks.put(None)
            rest = await reader.read()
            writer.close()
        assert status == 200
        assert headers["connection"] == "close"
        assert "transfer-encoding" not in headers
        assert rest == b"data: [DONE]\n\n"
        assert feed.ended_by == "exhausted"

    run(scenario())


def test_expect_100_continue_is_answered_before_the_body_is_sent() -> None:
    async def scenario() -> None:
        async with serving() as (_, port):
            reader, writer = await connect(port)
            body = b"x" * 2000
            head = get("/up", f"Content-Length: {len(body)}", "Expect: 100-continue", method="POST")
            writer.write(head)
            interim = await reader.readuntil(b"\r\n\r\n")
            writer.write(body)
            response = await read_response(reader)
            writer.close()
        assert interim == b"HTTP/1.1 100 Continue\r\n\r\n"
        assert response.status == 200
        assert response.json()["body"] == "x" * 2000

    run(scenario())


def test_chunked_request_body_with_extensions_and_trailers() -> None:
    async def scenario() -> None:
        async with serving() as (_, port):
            reader, writer = await connect(port)
            writer.write(
                get("/c", "Transfer-Encoding: chunked", method="POST")
                + b"5;ext=1\r\nhello\r\n1\r\n \r\n5\r\nworld\r\n0\r\nX-Trailer: t\r\n\r\n"
            )
            response = await read_response(reader)
            writer.write(get("/after"))
            after = await read_response(reader)
            writer.close()
        assert response.json()["body"] == "hello world"
        assert after.json()["path"] == "/after"

    run(scenario())


def test_a_body_of_ten_thousand_one_byte_chunks_arrives_whole() -> None:
    async def scenario() -> None:
        async with serving() as (_, port):
            text = "".join(chr(ord("a") + n % 26) for n in range(10_000))
            chunks = b"".join(b"1\r\n" + c.encode() + b"\r\n" for c in text) + b"0\r\n\r\n"
            head = get("/c", "Transfer-Encoding: chunked", "Connection: close", method="POST")
            response, _ = await exchange(port, head + chunks)
        assert response.json()["body"] == text

    run(scenario())


def test_two_thousand_tiny_pipelined_requests_in_one_write_are_all_answered_in_order() -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app) as (_, port):
            reader, writer = await connect(port)
            writer.write(b"".join(f"GET /{n} HTTP/1.1\r\n\r\n".encode() for n in range(2000)))
            paths = [(await read_response(reader)).json()["path"] for _ in range(2000)]
            writer.close()
        assert paths == [f"/{n}" for n in range(2000)]
        assert app.most_in_flight == 1

    run(scenario())


def test_each_streamed_chunk_reaches_the_client_before_the_next_is_yielded() -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app) as (_, port):
            reader, writer = await connect(port)
            writer.write(post("/stream", b"{}"))
            status, _, headers = await read_head(reader)
            feed = app.feeds[0]
            received = []
            for n in range(3):
                await feed.chunks.put(f"data: {n}\n\n".encode())
                received.append(await read_chunk(reader))
                assert feed.chunks.empty()
            await feed.chunks.put(b"data: [DONE]\n\n")
            received.append(await read_chunk(reader))
            await feed.chunks.put(None)
            assert await read_chunk(reader) == b""
            writer.write(get("/next"))
            after = await read_response(reader)
            writer.close()
        assert status == 200
        assert headers["content-type"] == "text/event-stream; charset=utf-8"
        assert headers["transfer-encoding"] == "chunked"
        assert headers["x-stream"] == "1"
        assert "content-length" not in headers
        assert received == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b"data: [DONE]\n\n"]
        assert feed.ended_by == "exhausted"
        assert after.json()["path"] == "/next"

    run(scenario())


def test_a_client_leaving_mid_stream_gets_the_iterator_aclosed() -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app) as (server, port):
            reader, writer = await connect(port)
            writer.write(post("/stream", b"{}"))
            await read_head(reader)
            feed = app.feeds[0]
            await feed.chunks.put(b"data: 0\n\n")
            assert await read_chunk(reader) == b"data: 0\n\n"
            writer.close()
            await feed.closed.wait()
            await until(lambda: server.connections == 0, "the connection dropped")
        # The generator was waiting for its next chunk: the task driving it is cancelled
        # there, which closes it; the server's aclose() then finds it closed.
        assert feed.ended_by == "cancelled"

    run(scenario())


def test_a_client_leaving_mid_stream_reaches_a_plain_iterators_aclose() -> None:
    async def scenario() -> None:
        chunks = Chunks()

        async def handler(request: HttpRequest) -> StreamingResponse:
            return StreamingResponse(200, chunks)

        async with serving(handler=handler) as (server, port):
            reader, writer = await connect(port)
            writer.write(get("/"))
            await read_head(reader)
            await chunks.queue.put(b"data: tick\n\n")
            assert await read_chunk(reader) == b"data: tick\n\n"
            writer.close()
            await chunks.aclose_started.wait()
            chunks.aclose_may_end.set()
            await until(lambda: chunks.aclosed == 1, "aclose() finished")
            await until(lambda: server.connections == 0, "the connection dropped")
        assert chunks.aclosed == 1

    run(scenario())


def test_a_stream_that_fails_midway_is_cut_short_and_aclosed() -> None:
    async def scenario() -> None:
        chunks = Chunks()

        async def handler(request: HttpRequest) -> HttpResponse | StreamingResponse:
            if request.path == "/ok":
                return HttpResponse(200, b"ok")
            return StreamingResponse(200, chunks)

        async with serving(handler=handler) as (_, port):
            reader, writer = await connect(port)
            writer.write(get("/"))
            await read_head(reader)
            await chunks.queue.put(b"data: 0\n\n")
            assert await read_chunk(reader) == b"data: 0\n\n"
            await chunks.queue.put(RuntimeError("the engine went away"))
            await chunks.aclose_started.wait()
            chunks.aclose_may_end.set()
            with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
                await read_chunk(reader)
            await until(lambda: chunks.aclosed == 1, "aclose() finished")
            writer.close()
            response, _ = await exchange(port, get("/ok", "Connection: close"))
        assert response.body == b"ok"
        assert chunks.aclosed == 1

    run(scenario())


def test_a_stream_with_a_malformed_header_gets_a_500_and_is_aclosed() -> None:
    async def scenario() -> None:
        chunks = Chunks()
        chunks.aclose_may_end.set()

        async def handler(request: HttpRequest) -> StreamingResponse:
            return StreamingResponse(200, chunks, headers=(("x-split", "a\nb"),))

        async with serving(handler=handler) as (_, port):
            response, _ = await exchange(port, get("/", "Connection: close"))
        assert response.status == 500
        assert response.body == error_factory(500, "Internal Server Error").body
        assert chunks.aclosed == 1

    run(scenario())


def test_a_client_leaving_during_a_handler_cancels_it() -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app) as (_, port):
            _, writer = await connect(port)
            writer.write(get("/wait"))
            await app.waiting.wait()
            writer.close()
            await app.cancelled.wait()
        assert app.cancelled.is_set()

    run(scenario())


@pytest.mark.parametrize(
    ("path", "message"),
    [("/boom", "Internal Server Error"), ("/bad-header", "Internal Server Error")],
)
def test_a_failing_handler_gets_a_500_and_the_connection_goes_on(path: str, message: str) -> None:
    async def scenario() -> None:
        async with serving() as (_, port):
            reader, writer = await connect(port)
            writer.write(get(path))
            failed = await read_response(reader)
            writer.write(get("/next"))
            after = await read_response(reader)
            writer.close()
        assert failed.status == 500
        assert failed.body == error_factory(500, message).body
        assert "x-injected" not in failed.headers
        assert after.json()["path"] == "/next"

    run(scenario())


def test_head_requests_get_the_head_only_and_the_connection_stays_in_step() -> None:
    async def scenario() -> None:
        async with serving() as (_, port):
            reader, writer = await connect(port)
            writer.write(get("/h", method="HEAD") + get("/after"))
            head = await read_response(reader, head_only=True)
            after = await read_response(reader)
            writer.close()
        assert head.status == 200
        assert int(head.headers["content-length"]) > 0
        assert after.json()["path"] == "/after"

    run(scenario())


def test_shutdown_lets_a_stream_in_flight_finish_within_the_grace() -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app) as (server, port):
            reader, writer = await connect(port)
            writer.write(post("/stream", b"{}"))
            _, _, headers = await read_head(reader)
            idle_reader, idle_writer = await connect(port)
            await until(lambda: server.connections == 2, "both connections accepted")
            shutdown = asyncio.create_task(server.shutdown(60))
            assert await idle_reader.read() == b""
            feed = app.feeds[0]
            await feed.chunks.put(b"data: last\n\n")
            await feed.chunks.put(None)
            assert await read_chunk(reader) == b"data: last\n\n"
            assert await read_chunk(reader) == b""
            assert await reader.read() == b""
            await shutdown
            with pytest.raises(OSError):
                await connect(port)
            writer.close()
            idle_writer.close()
        assert feed.ended_by == "exhausted"
        assert "connection" not in headers

    run(scenario())


def test_shutdown_waits_for_a_cut_streams_aclose() -> None:
    async def scenario() -> None:
        chunks = Chunks()

        async def handler(request: HttpRequest) -> StreamingResponse:
            return StreamingResponse(200, chunks)

        async with serving(handler=handler) as (server, port):
            reader, writer = await connect(port)
            writer.write(get("/"))
            await read_head(reader)
            shutdown = asyncio.create_task(server.shutdown(0.01))
            await chunks.aclose_started.wait()
            assert not shutdown.done()
            chunks.aclose_may_end.set()
            await shutdown
            writer.close()
        assert chunks.aclosed == 1

    run(scenario())


def test_shutdown_cuts_a_stream_still_running_after_the_grace_and_acloses_it() -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app) as (server, port):
            reader, writer = await connect(port)
            writer.write(post("/stream", b"{}"))
            await read_head(reader)
            feed = app.feeds[0]
            await feed.chunks.put(b"data: 0\n\n")
            assert await read_chunk(reader) == b"data: 0\n\n"
            await server.shutdown(0.01)
            assert feed.closed.is_set()
            with pytest.raises((asyncio.IncompleteReadError, ConnectionError)):
                await read_chunk(reader)
            writer.close()
        assert feed.ended_by == "cancelled"

    run(scenario())


def test_an_error_factory_that_fails_still_gives_the_client_its_status() -> None:
    async def scenario() -> None:
        def broken(status: int, message: str) -> HttpResponse:
            raise ValueError("no")

        async def handler(request: HttpRequest) -> HttpResponse:
            raise RuntimeError("and the handler fails")

        async with serving(handler=handler, factory=broken) as (_, port):
            response, rest = await exchange(port, get("/", "Connection: close"))
            malformed, _ = await exchange(port, b"NOT HTTP\r\n\r\n")
        assert response.status == 500
        assert response.headers["content-type"] == "text/plain; charset=utf-8"
        assert response.body == b"Internal Server Error"
        assert rest == b""
        assert malformed.status == 400
        assert malformed.headers["content-type"] == "text/plain; charset=utf-8"
        assert malformed.body.startswith(b"Invalid HTTP request received")

    run(scenario())
