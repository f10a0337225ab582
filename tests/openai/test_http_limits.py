"""The HTTP server's bounds and refusals, on real loopback sockets: malformed, huge and slow input.

Each refusal carries the app's error shape (`error_factory`) with its status, closes the
connection, and leaves the server serving the next client. Deadlines are tiny (tens of
milliseconds) so the tests wait for the server's verdict, never for a clock; they assert what
the client meets, never how long it took.
"""

from __future__ import annotations

import asyncio
import json
import resource
import socket

import pytest

from engined.openai.http import HttpLimits, HttpRequest, StreamingResponse
from tests.openai.http_support import (
    App,
    Chunks,
    Response,
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

SHORT = 0.05  # a deadline a test runs into at once; never a duration it asserts


def assert_refused(response: Response, status: int, message: str) -> None:
    assert response.status == status
    assert response.headers["connection"] == "close"
    assert response.headers["content-type"] == "application/json"
    body = json.loads(response.body)
    assert body["error"]["code"] == status
    assert body["error"]["message"] == message, body


async def still_serves(port: int) -> None:
    response, rest = await exchange(port, get("/after", "Connection: close"))
    assert response.json()["path"] == "/after"
    assert rest == b""


MALFORMED = {
    "bad request line": (b"GARBAGE\r\n\r\n", "Invalid method encountered"),
    "lower-case method": (b"get / HTTP/1.1\r\n\r\n", "Invalid method encountered"),
    "bad version": (b"GET / HTTP/9.9\r\nHost: x\r\n\r\n", "Invalid HTTP version"),
    "space in the target": (b"GET /a b HTTP/1.1\r\n\r\n", "Expected HTTP/, RTSP/ or ICE/"),
    "non-ASCII target": (b"GET /\xc3\xa9 HTTP/1.1\r\n\r\n", "Invalid char in url path"),
    "header without colon": (b"GET / HTTP/1.1\r\nHost x\r\n\r\n", "Invalid header token"),
    "space before colon": (b"GET / HTTP/1.1\r\nHost : x\r\n\r\n", "Invalid header token"),
    "NUL in a header": (b"GET / HTTP/1.1\r\nX: a\x00b\r\n\r\n", "Invalid header value char"),
    "folded header": (
        b"GET / HTTP/1.1\r\nX: a\r\n b\r\n\r\n",
        "Unexpected whitespace after header value",
    ),
    "bare LF": (b"GET / HTTP/1.1\nHost: x\n\n", "Expected CRLF after version"),
    "invalid Content-Length": (
        b"POST / HTTP/1.1\r\nContent-Length: 1x\r\n\r\n",
        "Invalid character in Content-Length",
    ),
    "negative Content-Length": (
        b"POST / HTTP/1.1\r\nContent-Length: -1\r\n\r\n",
        "Invalid character in Content-Length",
    ),
    "two Content-Lengths": (
        b"POST / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
        "Duplicate Content-Length",
    ),
    "Content-Length with chunked": (
        b"POST / HTTP/1.1\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
        "Transfer-Encoding can't be present with Content-Length",
    ),
    "unknown transfer coding": (
        b"POST / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\nabc",
        "Request has invalid `Transfer-Encoding`",
    ),
    "bad chunk size": (
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
        "Invalid character in chunk size",
    ),
    "chunk longer than said": (
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabcX\r\n0\r\n\r\n",
        "Expected LF after chunk data",
    ),
    "chunk size overflow": (
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nFFFFFFFFFFFFFFFFFF\r\n",
        "Chunk size overflow",
    ),
    "TLS client hello": (bytes.fromhex("16030102000100020003") + b"\x00" * 8, "Invalid method"),
    "HTTP/2 preface": (b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n", "Pause on PRI/Upgrade"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_http_gets_400_and_the_server_goes_on(case: str) -> None:
    data, reason = MALFORMED[case]

    async def scenario() -> None:
        app = App()
        async with serving(app) as (_, port):
            response, rest = await exchange(port, data)
            await still_serves(port)
        message = json.loads(response.body)["error"]["message"]
        assert_refused(response, 400, message)
        assert message.startswith("Invalid HTTP request received: ")
        assert reason in message
        assert rest == b""
        assert [request.path for request in app.requests] == ["/after"]

    run(scenario())


def test_malformed_request_after_a_good_one_is_answered_after_it() -> None:
    async def scenario() -> None:
        async with serving() as (_, port):
            reader, writer = await connect(port)
            writer.write(get("/ok") + b"GET / HTTP/1.1\r\nbad header\r\n\r\n" + get("/never"))
            good = await read_response(reader)
            bad = await read_response(reader)
            rest = await reader.read()
            writer.close()
        assert good.json()["path"] == "/ok"
        assert bad.status == 400
        assert rest == b""

    run(scenario())


def test_an_upgrade_request_is_answered_and_the_connection_closed() -> None:
    async def scenario() -> None:
        async with serving() as (_, port):
            data = get("/up", "Connection: upgrade", "Upgrade: h2c") + b"\x00binary"
            response, rest = await exchange(port, data)
        assert response.json()["path"] == "/up"
        assert response.headers["connection"] == "close"
        assert rest == b""

    run(scenario())


def test_huge_heads_get_431() -> None:
    limits = HttpLimits(max_head_bytes=1024, max_headers=4)

    async def scenario() -> None:
        async with serving(limits=limits) as (_, port):
            long_header, _ = await exchange(port, get("/", "X-Big: " + "a" * 2000))
            many_headers, _ = await exchange(port, get("/", *(f"X-{n}: {n}" for n in range(4))))
            # A header line that never ends: the server cannot wait for its callback.
            endless, _ = await exchange(port, b"GET / HTTP/1.1\r\nX-Endless: " + b"a" * 40_000)
            long_target, _ = await exchange(port, get("/" + "a" * 2000))
            fits, _ = await exchange(port, get("/", "Connection: close", "X-Fits: " + "a" * 500))
            await still_serves(port)
        size = "Request header fields too large (limit 1024 bytes)"
        assert_refused(long_header, 431, size)
        assert_refused(many_headers, 431, "Request header fields too large (limit 4 headers)")
        assert_refused(endless, 431, size)
        assert_refused(long_target, 431, size)
        assert fits.status == 200

    run(scenario())


def test_huge_bodies_get_413_without_being_read() -> None:
    limits = HttpLimits(max_body_bytes=1000)

    async def scenario() -> None:
        async with serving(limits=limits) as (_, port):
            # Declared: refused on the head alone; not one byte of the body is sent.
            declared, rest = await exchange(
                port, get("/", "Content-Length: 1000000000", method="POST")
            )
            assert rest == b""
            # Declared with Expect: refused instead of a 100 Continue.
            expecting, _ = await exchange(
                port, get("/", "Content-Length: 1001", "Expect: 100-continue", method="POST")
            )
            # Chunked: refused once the chunks pass the bound.
            chunks = b"".join(b"1f4\r\n" + b"z" * 500 + b"\r\n" for _ in range(3))
            chunked, _ = await exchange(
                port, get("/", "Transfer-Encoding: chunked", method="POST") + chunks
            )
            exact, _ = await exchange(port, post("/", b"y" * 1000, "Connection: close"))
            await still_serves(port)
        message = "Request body too large (limit 1000 bytes)"
        assert_refused(declared, 413, message)
        assert_refused(expecting, 413, message)
        assert_refused(chunked, 413, message)
        assert exact.json()["body"] == "y" * 1000

    run(scenario())


def test_a_slow_head_gets_408_and_the_connection_closes() -> None:
    async def scenario() -> None:
        async with serving(limits=HttpLimits(head_timeout_s=SHORT)) as (_, port):
            response, rest = await exchange(port, b"GET / HTTP/1.1\r\nHost: loc")
            await still_serves(port)
        assert_refused(response, 408, f"Request header not received within {SHORT} s")
        assert rest == b""

    run(scenario())


def test_a_slow_body_gets_408_and_the_connection_closes() -> None:
    async def scenario() -> None:
        async with serving(limits=HttpLimits(body_timeout_s=SHORT)) as (_, port):
            length, chunked = await asyncio.gather(
                exchange(port, get("/", "Content-Length: 10", method="POST") + b"abc"),
                exchange(port, get("/", "Transfer-Encoding: chunked", method="POST") + b"5\r\nab"),
            )
            await still_serves(port)
        for response, rest in (length, chunked):
            assert_refused(response, 408, f"Request body not received within {SHORT} s")
            assert rest == b""

    run(scenario())


def test_idle_connections_are_closed_silently_after_the_keep_alive() -> None:
    async def scenario() -> None:
        async with serving(limits=HttpLimits(keep_alive_s=SHORT)) as (server, port):
            reader, writer = await connect(port)
            writer.write(get("/one"))
            served = await read_response(reader)
            after_request = await reader.read()
            writer.close()
            fresh_reader, fresh_writer = await connect(port)
            fresh = await fresh_reader.read()
            fresh_writer.close()
            await until(lambda: server.connections == 0, "both closed")
        assert served.json()["path"] == "/one"
        assert after_request == b""
        assert fresh == b""

    run(scenario())


def test_a_client_that_never_reads_a_stream_is_cut_and_its_iterator_aclosed() -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app, HttpLimits(write_timeout_s=SHORT)) as (server, port):
            writer = await never_reading_client(port, post("/stream", b"{}"))
            await until(lambda: app.feeds, "the stream started")
            feed = app.feeds[0]
            for _ in range(64):
                await feed.chunks.put(b"x" * 65536)
            await feed.closed.wait()
            await until(lambda: server.connections == 0, "the connection cut")
            writer.close()
        # Cut while the stream waited on the socket, not on the generator: aclose() ends it.
        assert feed.ended_by == "aclose"
        assert not feed.chunks.empty()  # it stopped taking chunks when the client stalled

    run(scenario())


def test_a_stalled_streams_aclose_may_await() -> None:
    async def scenario() -> None:
        chunks = Chunks()

        async def handler(request: HttpRequest) -> StreamingResponse:
            return StreamingResponse(200, chunks)

        limits = HttpLimits(write_timeout_s=SHORT)
        async with serving(handler=handler, limits=limits) as (server, port):
            writer = await never_reading_client(port, get("/"))
            for _ in range(64):
                await chunks.queue.put(b"x" * 65536)
            await chunks.aclose_started.wait()
            await until(lambda: server.connections == 0, "the connection cut")
            chunks.aclose_may_end.set()
            await until(lambda: chunks.aclosed == 1, "aclose() finished")
            writer.close()
        assert chunks.aclosed == 1

    run(scenario())


async def never_reading_client(port: int, request: bytes) -> asyncio.StreamWriter:
    """A connection with a small receive buffer that sends `request` and reads nothing."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.setblocking(False)
    _, writer = await asyncio.open_connection(sock=sock)
    writer.write(request)
    return writer


def test_a_pipelining_client_cannot_make_the_server_buffer_without_bound() -> None:
    async def scenario() -> None:
        app = App()
        async with serving(app) as (server, port):
            reader, writer = await connect(port)
            writer.write(get("/hold"))
            await app.waiting.wait()
            # 16 MiB of pipelined requests while the first is in flight: the server stops
            # reading once 64 KiB of them wait unparsed (plus at most one 256 KiB read).
            body = b"p" * 65536
            writer.write(post("/p", body) * 256)
            await until(lambda: server.unparsed_bytes >= 65536, "the backlog filled")
            held = server.unparsed_bytes
            backed_up = writer.transport.get_write_buffer_size()
            app.release.set()
            first = await read_response(reader)
            rest = [await read_response(reader) for _ in range(256)]
            writer.close()
        assert 65536 <= held < 65536 + 262144
        assert backed_up > 0
        assert first.json()["path"] == "/hold"
        assert all(r.json()["body"] == body.decode() for r in rest)
        assert app.most_in_flight == 1
        assert len(app.requests) == 257

    run(scenario())


def test_the_connection_cap_answers_503_and_frees_its_slot() -> None:
    async def scenario() -> None:
        async with serving(limits=HttpLimits(max_connections=2)) as (server, port):
            first = await connect(port)
            second = await connect(port)
            await until(lambda: server.connections == 2, "two connections held")
            refused, rest = await exchange(port, get("/"))
            first[1].close()
            await until(lambda: server.connections == 1, "a slot freed")
            await still_serves(port)
            second[1].write(get("/held"))
            held = await read_response(second[0])
            second[1].close()
        assert_refused(refused, 503, "Too many connections to the server; try again later")
        assert rest == b""
        assert held.json()["path"] == "/held"

    run(scenario())


def test_two_thousand_idle_connections_leave_an_active_client_served() -> None:
    idle_count = 2000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = 2 * idle_count + 256
    if soft < needed:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(needed, hard), hard))
    assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] >= needed, "raise the descriptor limit"

    async def scenario() -> None:
        app = App()
        async with serving(app) as (server, port):
            idle = [await connect(port) for _ in range(idle_count)]
            await until(lambda: server.connections == idle_count, "all idle connections held")
            reader, writer = await connect(port)
            bodies = []
            for n in range(20):
                writer.write(post(f"/{n}", b"{}"))
                bodies.append((await read_response(reader)).json()["path"])
            writer.write(post("/stream", b"{}"))
            await read_head(reader)
            feed = app.feeds[0]
            await feed.chunks.put(b"data: 0\n\n")
            first_chunk = await read_chunk(reader)
            await feed.chunks.put(None)
            assert await read_chunk(reader) == b""
            open_at_the_end = server.connections
            writer.close()
            for _, idle_writer in idle:
                idle_writer.close()
        assert bodies == [f"/{n}" for n in range(20)]
        assert first_chunk == b"data: 0\n\n"
        assert open_at_the_end == idle_count + 1

    run(scenario())


def test_limits_refuse_nonsense() -> None:
    with pytest.raises(ValueError, match="max_body_bytes"):
        HttpLimits(max_body_bytes=0)
    with pytest.raises(ValueError, match="keep_alive_s"):
        HttpLimits(keep_alive_s=0)
    assert error_factory(413, "x").status == 413
