"""Bearer keys on the HTTP server (issue 21): vLLM 0.33's rule, status and body, exactly.

vLLM's `AuthenticationMiddleware` guards the paths under `/v1`, `/v2`, `/inference` and
`/cohere` (string prefixes of the decoded path), skips OPTIONS, reads the first
`Authorization` header, splits it at its first space, takes the scheme `bearer` in any case
and the rest verbatim, and answers 401 `{"error":"Unauthorized"}` (application/json). The
first tests pin that rule on an `HttpServer`; the live ones run real daemons on loopback with
the key from each source, and the head bounds (431, 408) in front of the check.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.registry import Collector, CollectorRegistry

from engined.server.ops import http_endpoint as http_module
from engined.server.ops.http_endpoint import HttpServer
from tests.server.daemon_harness import DaemonProcess, start_daemon
from tests.server.test_metrics import Response, http_raw, parse
from tests.server.test_rank_processes import config, serving
from tests.support import free_tcp_port, run

KEY = "sk-engined-test-91c2"
OTHER_KEY = "second key"
UNAUTHORIZED = b'{"error":"Unauthorized"}'


@pytest.fixture(autouse=True)
def no_inherited_key(monkeypatch: pytest.MonkeyPatch) -> None:
    """A VLLM_API_KEY in the shell would reach every daemon these tests start."""
    monkeypatch.delenv("VLLM_API_KEY", raising=False)


async def request(port: int, path: str, *headers: str, method: str = "GET") -> Response:
    lines = [f"{method} {path} HTTP/1.1", "Host: localhost", *headers]
    response = await http_raw(port, ("\r\n".join(lines) + "\r\n\r\n").encode())
    assert response is not None
    return response


def assert_refused(response: Response, *, head_only: bool = False) -> None:
    assert response.status == 401
    assert response.headers["content-type"] == "application/json"
    assert response.headers["content-length"] == str(len(UNAUTHORIZED))
    assert response.body == (b"" if head_only else UNAUTHORIZED)


class Counting(Collector):
    """A registry content that counts how often a scrape renders it."""

    def __init__(self) -> None:
        self.collects = 0

    def collect(self) -> Iterator[Any]:
        self.collects += 1
        return iter(())


class Served:
    def __init__(self, keys: tuple[str, ...], guard_metrics: bool) -> None:
        self.collector = Counting()
        self.refreshes = 0
        registry = CollectorRegistry()
        registry.register(self.collector)

        async def before_scrape() -> None:
            self.refreshes += 1

        self.server = HttpServer(
            registry,
            health=lambda: "serving",
            before_scrape=before_scrape,
            api_keys=keys,
            guard_metrics=guard_metrics,
        )


async def serve(keys: tuple[str, ...] = (KEY, OTHER_KEY), *, guard_metrics: bool = False) -> Served:
    served = Served(keys, guard_metrics)
    await served.server.start("127.0.0.1", 0)
    return served


# --- the rule, on an HttpServer ---------------------------------------------------------------


GUARDED = ["/v1/models", "/v1", "/v1x", "/v2/a", "/inference/b", "/cohere/c", "/%761/models"]


def test_guarded_paths_need_a_key_and_the_rest_stay_open() -> None:
    async def scenario() -> None:
        served = await serve()
        port = served.server.port
        try:
            for path in GUARDED:
                assert_refused(await request(port, path))
                assert_refused(await request(port, path, method="POST"))
                assert_refused(await request(port, path, method="HEAD"), head_only=True)
                for key in (KEY, OTHER_KEY):
                    allowed = await request(port, path, f"Authorization: Bearer {key}")
                    assert (allowed.status, allowed.body) == (404, b"not found\n")
                # CORS preflights pass unauthenticated, as in vLLM.
                assert (await request(port, path, method="OPTIONS")).status == 404
            for path, status in (("/health", 200), ("/metrics", 200), ("/nope", 404), ("/V1", 404)):
                assert (await request(port, path)).status == status
            assert (await request(port, "/metrics", method="POST")).status == 405
        finally:
            await served.server.close()

    run(scenario())


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ((), 401),
        (("Authorization:",), 401),
        (("Authorization: Bearer",), 401),
        (("Authorization: Bearer ",), 401),
        ((f"Authorization: Basic {KEY}",), 401),
        ((f"Authorization: Token {KEY}",), 401),
        ((f"Authorization: {KEY}",), 401),
        ((f"Authorization: Bearer  {KEY}",), 401),
        ((f"Authorization: Bearer\t{KEY}",), 401),
        ((f"Authorization: Bearer {KEY}x",), 401),
        ((f"Authorization: Bearer {KEY[:-1]}",), 401),
        ((f"Authorization: Bearer {KEY.upper()}",), 401),
        (("Authorization: Bearer second",), 401),
        ((f"X-Api-Key: {KEY}",), 401),
        ((f"Authorization: Bearer {KEY}",), 404),
        ((f"Authorization: bearer {KEY}",), 404),
        ((f"Authorization: BEARER {KEY}",), 404),
        ((f"authorization:Bearer {KEY}  ",), 404),
        ((f"AUTHORIZATION: Bearer {OTHER_KEY}",), 404),
        # The first of repeated headers counts, as Starlette's `Headers.get` reads them.
        (("Authorization: Bearer wrong", f"Authorization: Bearer {KEY}"), 401),
        ((f"Authorization: Bearer {KEY}", "Authorization: Bearer wrong"), 404),
    ],
)
def test_authorization_header_parsing(headers: tuple[str, ...], status: int) -> None:
    async def scenario() -> None:
        served = await serve()
        try:
            response = await request(served.server.port, "/v1/models", *headers)
            if status == 401:
                assert_refused(response)
            else:
                assert response.status == status
        finally:
            await served.server.close()

    run(scenario())


def test_a_refused_scrape_renders_nothing() -> None:
    """With `guard_metrics`, a scrape without the key is answered from its head alone."""

    async def scenario() -> None:
        served = await serve(guard_metrics=True)
        port = served.server.port
        try:
            for headers in ((), ("Authorization: Bearer wrong",), (f"Authorization: Basic {KEY}",)):
                assert_refused(await request(port, "/metrics", *headers))
            assert_refused(await request(port, "/metrics", method="POST"))
            assert (served.refreshes, served.collector.collects) == (0, 0)
            scraped = await request(port, "/metrics", f"Authorization: Bearer {KEY}")
            assert scraped.status == 200
            assert (served.refreshes, served.collector.collects) == (1, 1)
            assert (await request(port, "/health")).status == 200
        finally:
            await served.server.close()

    run(scenario())


def test_without_keys_nothing_is_guarded() -> None:
    async def scenario() -> None:
        served = await serve((), guard_metrics=True)
        port = served.server.port
        try:
            assert (await request(port, "/v1/models")).status == 404
            assert (await request(port, "/metrics")).status == 200
        finally:
            await served.server.close()

    run(scenario())


def test_every_key_is_compared_whichever_matches(monkeypatch: pytest.MonkeyPatch) -> None:
    """No early exit: the time taken must not tell which key matched, or whether one did."""
    compared: list[int] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(len(a))
        return compare(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)

    async def scenario() -> None:
        served = await serve(("a", "b", "c"))
        port = served.server.port
        try:
            for header, status in (("Bearer a", 404), ("Bearer c", 404), ("Bearer x", 401)):
                compared.clear()
                response = await request(port, "/v1/models", f"Authorization: {header}")
                assert response.status == status
                # Three keys, each compared as a SHA-256 digest whatever the key's length.
                assert compared == [32, 32, 32]
        finally:
            await served.server.close()

    run(scenario())


# --- live daemons -----------------------------------------------------------------------------


def http_log_line(daemon: DaemonProcess) -> dict[str, Any]:
    for line in daemon.log().splitlines():
        if line.startswith("{"):
            record: dict[str, Any] = json.loads(line)
            if record.get("event") == "http listening":
                return record
    raise AssertionError(f"no 'http listening' line:\n{daemon.log()}")


def key_file(tmp_path: Path, content: str, mode: int) -> Path:
    path = tmp_path / "api_key"
    path.write_text(content)
    path.chmod(mode)
    return path


def test_live_key_from_the_flag(tmp_path: Path) -> None:
    port = free_tcp_port()

    async def scenario() -> None:
        assert_refused(await request(port, "/v1/models"))
        assert_refused(await request(port, "/v1/models", f"Authorization: Basic {KEY}"))
        assert_refused(await request(port, "/v1/models", "Authorization: Bearer wrong"))
        allowed = await request(port, "/v1/models", f"Authorization: Bearer {KEY}")
        assert allowed.status == 404
        # As vLLM: the probe and the scrape need no key.
        assert (await request(port, "/health")).status == 200
        metrics = await request(port, "/metrics")
        assert metrics.status == 200
        assert "vllm:cache_config_info" in parse(metrics.body.decode())

    with start_daemon(tmp_path, "--http-port", str(port), "--api-key", KEY) as daemon:
        run(scenario())
        record = http_log_line(daemon)
        assert (record["api_keys"], record["metrics_need_key"]) == (1, False)
    assert KEY not in daemon.log()


def test_live_key_from_vllm_api_key(tmp_path: Path) -> None:
    port = free_tcp_port()

    async def scenario() -> None:
        assert_refused(await request(port, "/v1/completions", method="POST"))
        allowed = await request(port, "/v1/completions", f"Authorization: Bearer {KEY}")
        assert allowed.status == 404

    with start_daemon(tmp_path, "--http-port", str(port), env={"VLLM_API_KEY": KEY}) as daemon:
        run(scenario())
    assert KEY not in daemon.log()


def test_live_keys_from_a_file_guarding_metrics_too(tmp_path: Path) -> None:
    port = free_tcp_port()
    path = key_file(tmp_path, f"{KEY}\n{OTHER_KEY}\n", 0o600)

    async def scenario() -> None:
        assert_refused(await request(port, "/metrics"))
        assert_refused(await request(port, "/v1/models", "Authorization: Bearer wrong"))
        for key in (KEY, OTHER_KEY):
            scraped = await request(port, "/metrics", f"Authorization: Bearer {key}")
            assert scraped.status == 200
            assert "vllm:cache_config_info" in parse(scraped.body.decode())
            assert (await request(port, "/v1/models", f"Authorization: Bearer {key}")).status == 404
        assert (await request(port, "/health")).status == 200

    args = ("--http-port", str(port), "--api-key-file", str(path), "--api-key-metrics")
    with start_daemon(tmp_path, *args) as daemon:
        run(scenario())
        record = http_log_line(daemon)
        assert (record["api_keys"], record["metrics_need_key"]) == (2, True)
    assert KEY not in daemon.log() and OTHER_KEY not in daemon.log()


def test_live_world_readable_key_file_is_refused_before_binding(tmp_path: Path) -> None:
    port = free_tcp_port()
    path = key_file(tmp_path, f"{KEY}\n", 0o644)
    daemon = DaemonProcess(tmp_path, ["--http-port", str(port), "--api-key-file", str(path)], None)
    try:
        assert daemon.proc.wait(30) == 2, daemon.log()
    finally:
        daemon.stop()
    assert daemon.log() == (
        f"error: api_key_file: {path} can be read by every user (mode 0644); make it 0600 or "
        "0640 (from --api-key-file)\n"
    )
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", port))


def test_live_huge_authorization_header_is_a_431(tmp_path: Path) -> None:
    port = free_tcp_port()

    async def scenario() -> None:
        huge = await request(port, "/v1/models", f"Authorization: Bearer {'k' * 20_000}")
        assert (huge.status, huge.body) == (431, b"request head too large\n")
        allowed = await request(port, "/v1/models", f"Authorization: Bearer {KEY}")
        assert allowed.status == 404

    with start_daemon(tmp_path, "--http-port", str(port), "--api-key", KEY):
        run(scenario())


def test_slow_sender_is_a_408_and_the_daemon_serves_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon in this process, so that the 10 s head timeout can be made 0.5 s."""
    monkeypatch.setattr(http_module, "IO_TIMEOUT_S", 0.5)
    port = free_tcp_port()

    async def scenario() -> None:
        cfg = config(tmp_path, 1, http_port=port, api_key=KEY, api_key_metrics=True)
        async with serving(cfg, 0):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                # A head that never ends: the key arrives, the blank line never does.
                writer.write(f"GET /metrics HTTP/1.1\r\nAuthorization: Bearer {KEY}\r\n".encode())
                await writer.drain()
                answer = await asyncio.wait_for(reader.read(), 10)
            finally:
                writer.close()
            assert answer.startswith(b"HTTP/1.1 408 Request Timeout\r\n")
            assert answer.endswith(b"\r\n\r\nrequest not received in time\n")
            assert_refused(await request(port, "/metrics"))
            scraped = await request(port, "/metrics", f"Authorization: Bearer {KEY}")
            assert scraped.status == 200

    run(scenario())
