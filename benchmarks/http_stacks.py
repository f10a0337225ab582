"""Which HTTP stack the API server should stand on: the same trivial app on each candidate.

Issue 22 asks for the choice by measurement. Each stack serves two routes, one server process
at a time, on loopback:

* `POST /stream`: a ~200-byte JSON body in; 256 SSE events of ~150 bytes out, each written
  and flushed as its own chunk (`data: {...}\\n\\n`, chunked transfer encoding), then
  `data: [DONE]`. This is a streaming completion's shape.
* `POST /json`: a ~200-byte JSON body in, a ~300-byte JSON body out (Content-Length).

and `GET /rusage`: `resource.getrusage(RUSAGE_SELF)` of the process that runs the app, read
before and after each workload. CPU seconds per 1,000 events or requests are the figure that
holds on a noisy shared machine; events/s and requests/s move with whatever else runs.

The load generator runs in processes of its own (`--load-procs`, default 1): raw sockets on
uvloop (an asyncio `Protocol` per connection, requests pre-encoded, responses only scanned for
their end with `bytes.endswith`/`find`), so it costs far less than any server it drives.
Every response is checked (status 200, 256 events and `[DONE]` per stream); a stack that
answers wrongly fails the run.

Stacks (`--stacks`, default all):

* `raw`: a plain asyncio `Protocol` with the `httptools` parser (llhttp, what uvicorn uses),
  on uvloop: what engined would build itself.
* `raw-coalesced`: the same, but the chunks a stream yields within one turn of the event loop
  leave in one write (`call_soon`), as granian's Rust side merges them: how much of a stack's
  streaming cost is one `send` per chunk rather than the stack.
* `uvicorn`: uvicorn + uvloop + httptools, a raw ASGI app (no framework).
* `granian-asgi`, `granian-rsgi`: granian (Rust, hyper) with one worker, its uvloop loop.
* `aiohttp`: aiohttp.web on uvloop.
* `engined`: engined.openai.http.HttpServer (the server this choice led to), on uvloop;
  `engined-asyncio` the same on asyncio's own loop (does uvloop matter?).

Run it in a scratch venv with every candidate, never the project's own (the checkout this
file is in is put on `sys.path` for the `engined` stacks; structlog, msgspec and xxhash are
what importing it needs):

    python3 -m venv .venv-bench
    .venv-bench/bin/pip install httptools uvloop uvicorn granian aiohttp structlog msgspec xxhash
    .venv-bench/bin/python benchmarks/http_stacks.py [--stacks raw uvicorn] [--repeat 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

STACKS = (
    "raw",
    "raw-coalesced",
    "uvicorn",
    "granian-asgi",
    "granian-rsgi",
    "aiohttp",
    "engined",
    "engined-asyncio",
)
EVENTS = 256
_EVENT = (
    b'data: {"id":"cmpl-0123456789abcdef","object":"text_completion","created":1764720000,'
    b'"model":"tiny","choices":[{"index":0,"text":" word","finish_reason":null}]}\n\n'
)
_DONE = b"data: [DONE]\n\n"
_JSON_OUT = (
    b'{"id":"cmpl-0123456789abcdef","object":"text_completion","created":1764720000,'
    b'"model":"tiny","choices":[{"index":0,"text":" hello there","logprobs":null,'
    b'"finish_reason":"length"}],"usage":{"prompt_tokens":5,"total_tokens":7,'
    b'"completion_tokens":2,"prompt_tokens_details":null}}'
)
_BODY_IN = json.dumps(
    {
        "model": "tiny",
        "prompt": "The quick brown fox jumps over the lazy dog, again and again.",
        "max_tokens": 256,
        "stream": True,
        "temperature": 0.0,
        "stream_options": {"include_usage": True},
    }
).encode()


def _rusage() -> bytes:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return json.dumps({"cpu_s": usage.ru_utime + usage.ru_stime}).encode()


def _answer(body: bytes) -> None:
    """What every app does with the request body, so that no stack skips the decoding."""
    json.loads(body)


# --- the apps ----------------------------------------------------------------------------


async def asgi_app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] != "http":
        return
    body = b""
    more = True
    while more:
        message = await receive()
        body += message.get("body", b"")
        more = message.get("more_body", False)
    path = scope["path"]
    if path == "/rusage":
        await _asgi_send(send, 200, _rusage())
    elif path == "/json":
        _answer(body)
        await _asgi_send(send, 200, _JSON_OUT)
    else:
        _answer(body)
        headers = [(b"content-type", b"text/event-stream; charset=utf-8")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for _ in range(EVENTS):
            await send({"type": "http.response.body", "body": _EVENT, "more_body": True})
        await send({"type": "http.response.body", "body": _DONE, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _asgi_send(send: Any, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def rsgi_app(scope: Any, proto: Any) -> None:
    body = await proto()
    if scope.path == "/rusage":
        proto.response_bytes(200, [("content-type", "application/json")], _rusage())
    elif scope.path == "/json":
        _answer(body)
        proto.response_bytes(200, [("content-type", "application/json")], _JSON_OUT)
    else:
        _answer(body)
        transport = proto.response_stream(200, [("content-type", "text/event-stream")])
        for _ in range(EVENTS):
            await transport.send_bytes(_EVENT)
        await transport.send_bytes(_DONE)


def _aiohttp_app() -> Any:
    from aiohttp import web

    async def stream(request: web.Request) -> web.StreamResponse:
        _answer(await request.read())
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        response.enable_chunked_encoding()
        await response.prepare(request)
        for _ in range(EVENTS):
            await response.write(_EVENT)
        await response.write(_DONE)
        await response.write_eof()
        return response

    async def small(request: web.Request) -> web.Response:
        _answer(await request.read())
        return web.Response(body=_JSON_OUT, content_type="application/json")

    async def usage(request: web.Request) -> web.Response:
        return web.Response(body=_rusage(), content_type="application/json")

    app = web.Application()
    app.router.add_post("/stream", stream)
    app.router.add_post("/json", small)
    app.router.add_get("/rusage", usage)
    return app


class _RawProtocol(asyncio.Protocol):
    """The `raw` stack: httptools callbacks straight into the app, one request at a time."""

    def __init__(self, coalesce: bool = False) -> None:
        import httptools

        self._coalesce = coalesce
        self._pending: list[bytes] = []
        self._parser = httptools.HttpRequestParser(self)
        self._transport: asyncio.Transport | None = None
        self._url = b""
        self._body: list[bytes] = []
        self._queue: list[tuple[bytes, bytes, bool]] = []
        self._busy = False
        self._task: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        import httptools

        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            assert self._transport is not None
            self._transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\n\r\n")
            self._transport.close()

    def on_url(self, url: bytes) -> None:
        self._url += url

    def on_body(self, body: bytes) -> None:
        self._body.append(body)

    def on_message_complete(self) -> None:
        request = (self._url, b"".join(self._body), self._parser.should_keep_alive())
        self._url, self._body = b"", []
        self._queue.append(request)
        if not self._busy:
            self._busy = True
            self._task = asyncio.ensure_future(self._serve())

    async def _serve(self) -> None:
        transport = self._transport
        assert transport is not None
        while self._queue:
            url, body, keep_alive = self._queue.pop(0)
            if url == b"/rusage":
                self._write_full(_rusage())
            elif url == b"/json":
                _answer(body)
                self._write_full(_JSON_OUT)
            else:
                _answer(body)
                transport.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream; charset=utf-8\r\n"
                    b"transfer-encoding: chunked\r\n\r\n"
                )
                async for event in _events():
                    self._write(b"%x\r\n%b\r\n" % (len(event), event))
                self._write(b"0\r\n\r\n")
            if not keep_alive:
                transport.close()
        self._busy = False

    def _write(self, data: bytes) -> None:
        assert self._transport is not None
        if not self._coalesce:
            self._transport.write(data)
            return
        if not self._pending:
            asyncio.get_running_loop().call_soon(self._flush)
        self._pending.append(data)

    def _flush(self) -> None:
        assert self._transport is not None
        self._transport.write(b"".join(self._pending))
        self._pending.clear()

    def _write_full(self, body: bytes) -> None:
        assert self._transport is not None
        self._transport.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n%b"
            % (len(body), body)
        )


async def _events() -> AsyncIterator[bytes]:
    for _ in range(EVENTS):
        yield _EVENT
    yield _DONE


def _engined_server() -> Callable[[socket.socket], Awaitable[None]]:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from engined.openai.http import (
        HttpLimits,
        HttpRequest,
        HttpResponse,
        HttpServer,
        StreamingResponse,
    )

    async def handler(request: HttpRequest) -> HttpResponse | StreamingResponse:
        if request.path == "/rusage":
            return HttpResponse(200, _rusage())
        _answer(request.body)
        if request.path == "/json":
            return HttpResponse(200, _JSON_OUT)
        return StreamingResponse(200, _events())

    server = HttpServer(handler, lambda status, message: HttpResponse(status), HttpLimits())
    return server.serve


def serve(stack: str, port: int) -> None:
    """One server process of `stack` on 127.0.0.1:`port`, until killed."""
    import uvloop

    if stack in ("granian-asgi", "granian-rsgi"):
        interface = stack.split("-")[1]
        # NOTE: exec, so that this pid is granian's and the rusage route reports its worker.
        os.execv(
            sys.executable,
            [
                sys.executable,
                "-m",
                "granian",
                "--interface",
                interface,
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                "1",
                "--http",
                "1",
                "--loop",
                "uvloop",
                "--no-ws",
                "--log-level",
                "warning",
                "--working-dir",
                str(Path(__file__).parent),
                f"http_stacks:{interface}_app",
            ],
        )
    if stack == "uvicorn":
        import uvicorn

        uvicorn.run(
            asgi_app,
            host="127.0.0.1",
            port=port,
            loop="uvloop",
            http="httptools",
            lifespan="off",
            access_log=False,
            log_level="warning",
        )
        return
    if stack != "engined-asyncio":
        uvloop.install()
    asyncio.run(_serve_async(stack, port))


async def _serve_async(stack: str, port: int) -> None:
    loop = asyncio.get_running_loop()
    if stack in ("raw", "raw-coalesced"):
        coalesce = stack == "raw-coalesced"
        server = await loop.create_server(
            lambda: _RawProtocol(coalesce), "127.0.0.1", port, backlog=1024
        )
        await server.serve_forever()
    elif stack == "aiohttp":
        from aiohttp import web

        runner = web.AppRunner(_aiohttp_app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=1024).start()
        await asyncio.Event().wait()
    elif stack in ("engined", "engined-asyncio"):
        sock = socket.create_server(("127.0.0.1", port), backlog=1024)
        await _engined_server()(sock)


# --- the load generator --------------------------------------------------------------------


def _request(path: str, body: bytes) -> bytes:
    return (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


class _Client(asyncio.Protocol):
    """One keep-alive connection sending `count` requests one after another."""

    def __init__(self, request: bytes, streaming: bool, count: int, done: asyncio.Future[int]):
        self._request = request
        self._streaming = streaming
        self._left = count
        self._done = done
        self._buffer = bytearray()
        self._transport: asyncio.Transport | None = None
        self.errors = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]
        transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        buffer = self._buffer
        if self._streaming:
            if not buffer.endswith(b"0\r\n\r\n") or b"[DONE]" not in buffer:
                return
            ok = buffer.startswith(b"HTTP/1.1 200") and buffer.count(b"data: {") == EVENTS
        else:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(buffer[:end]).lower()
            start = head.find(b"content-length:")
            length = int(head[start + 15 :].split(b"\r\n", 1)[0])
            if len(buffer) < end + 4 + length:
                return
            ok = buffer.startswith(b"HTTP/1.1 200") and len(buffer) == end + 4 + length
        self.errors += not ok
        self._buffer = bytearray()
        self._left -= 1
        assert self._transport is not None
        if self._left:
            self._transport.write(self._request)
        else:
            self._transport.close()
            self._done.set_result(self.errors)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self._done.done():
            self._done.set_result(self._left + self.errors)


async def _load(port: int, streaming: bool, connections: int, per_connection: int) -> int:
    loop = asyncio.get_running_loop()
    request = _request("/stream" if streaming else "/json", _BODY_IN)
    futures: list[asyncio.Future[int]] = []
    for _ in range(connections):
        done: asyncio.Future[int] = loop.create_future()
        await loop.create_connection(
            lambda done=done: _Client(request, streaming, per_connection, done), "127.0.0.1", port
        )
        futures.append(done)
    return sum(await asyncio.gather(*futures))


def load_main(port: int, streaming: bool, connections: int, per_connection: int) -> None:
    import uvloop

    errors = uvloop.run(_load(port, streaming, connections, per_connection))
    print(json.dumps({"errors": errors}))


# --- the driver ----------------------------------------------------------------------------


def _server_cpu(port: int) -> float:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(b"GET /rusage HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
            if data.endswith(b"}"):
                break
    return float(json.loads(data.split(b"\r\n\r\n", 1)[1])["cpu_s"])


def _wait_listening(port: int, process: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited with {process.returncode}")
        try:
            _server_cpu(port)
            return
        except (OSError, ValueError, IndexError):
            time.sleep(0.1)
    raise SystemExit("server did not start")


def _run_load(port: int, streaming: bool, connections: int, requests: int, procs: int) -> float:
    per_connection = max(1, requests // connections)
    loaders = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--load",
                str(port),
                "stream" if streaming else "json",
                str(connections // procs),
                str(per_connection),
            ],
            stdout=subprocess.PIPE,
        )
        for _ in range(procs)
    ]
    started = time.perf_counter()
    errors = 0
    for loader in loaders:
        out, _ = loader.communicate()
        if loader.returncode != 0:
            raise SystemExit(f"load generator failed ({loader.returncode})")
        errors += json.loads(out)["errors"]
    elapsed = time.perf_counter() - started
    if errors:
        raise SystemExit(f"{errors} wrong or missing responses")
    return elapsed


def measure(stack: str, args: argparse.Namespace) -> dict[str, float]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    # NOTE: a session of its own, so that killing it takes granian's worker process too.
    server = subprocess.Popen(
        [sys.executable, __file__, "--serve", stack, str(port)], start_new_session=True
    )
    try:
        _wait_listening(port, server)
        _run_load(port, True, args.connections, args.connections, args.load_procs)
        results: dict[str, float] = {}
        for name, streaming, requests, unit in (
            ("stream", True, args.stream_requests, EVENTS),
            ("json", False, args.json_requests, 1),
        ):
            best_rate, best_cpu = 0.0, float("inf")
            for _ in range(args.repeat):
                cpu = _server_cpu(port)
                elapsed = _run_load(port, streaming, args.connections, requests, args.load_procs)
                cpu = _server_cpu(port) - cpu
                count = (requests // args.connections) * args.connections * unit
                best_rate = max(best_rate, count / elapsed)
                best_cpu = min(best_cpu, cpu / count * 1000)
            results[f"{name}_rate"] = best_rate
            results[f"{name}_cpu_ms"] = best_cpu * 1000
        return results
    finally:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        serve(sys.argv[2], int(sys.argv[3]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--load":
        port, kind, connections, per_connection = sys.argv[2:6]
        load_main(int(port), kind == "stream", int(connections), int(per_connection))
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--stacks", nargs="+", choices=STACKS, default=list(STACKS))
    parser.add_argument("--connections", type=int, default=64)
    parser.add_argument("--stream-requests", type=int, default=1024)
    parser.add_argument("--json-requests", type=int, default=32000)
    parser.add_argument("--load-procs", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3, help="best of N runs per workload")
    args = parser.parse_args()
    print(
        f"{os.uname().machine}, {os.cpu_count()} CPUs, "
        f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"load average {os.getloadavg()[0]:.2f}; {args.connections} keep-alive connections, "
        f"best of {args.repeat}"
    )
    print(
        "| stack | SSE events/s | server CPU ms / 1,000 events | JSON requests/s "
        "| server CPU ms / 1,000 requests |"
    )
    print("|---|---|---|---|---|")
    for stack in args.stacks:
        r = measure(stack, args)
        print(
            f"| {stack} | {r['stream_rate']:,.0f} | {r['stream_cpu_ms']:.1f} "
            f"| {r['json_rate']:,.0f} | {r['json_cpu_ms']:.1f} |",
            flush=True,
        )
    print(f"load average after: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
