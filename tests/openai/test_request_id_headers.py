"""vLLM's `--enable-request-id-headers` in a real `engined serve`: every answer of the API
server carries `X-Request-Id`, the request's own or a fresh uuid, refusals included (vLLM's
middleware sits outside its authentication); without the flag, none."""

from __future__ import annotations

import http.client
import json
import re
from pathlib import Path

from tests.openai.api_harness import start_api

KEY = "secret"
BODY = json.dumps({"model": "engined", "prompt": [1, 2, 3], "max_tokens": 2})


def exchange(port: int, method: str, path: str, headers: dict[str, str]) -> tuple[int, str | None]:
    """(status, the response's X-Request-Id) of one request, read to its end."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    try:
        body = BODY if method == "POST" else None
        connection.request(
            method, path, body=body, headers={"content-type": "application/json", **headers}
        )
        reply = connection.getresponse()
        reply.read()
        return reply.status, reply.getheader("x-request-id")
    finally:
        connection.close()


def test_every_answer_carries_the_request_id(tmp_path: Path) -> None:
    flags = ("--speedup-ratio", "0", "--enable-request-id-headers", "--api-key", KEY)
    auth = {"authorization": f"Bearer {KEY}"}
    with start_api(tmp_path, *flags) as api:
        port = api.port
        assert exchange(port, "POST", "/v1/completions", {**auth, "x-request-id": "abc"}) == (
            200,
            "abc",
        )
        status, fresh = exchange(port, "POST", "/v1/completions", auth)
        assert status == 200 and fresh is not None and re.fullmatch("[0-9a-f]{32}", fresh)
        # Refusals too: the key's 401, a route's 404, a method's 405.
        assert exchange(port, "POST", "/v1/completions", {"x-request-id": "r1"}) == (401, "r1")
        assert exchange(port, "GET", "/nowhere", {**auth, "x-request-id": "r2"}) == (404, "r2")
        assert exchange(port, "GET", "/v1/completions", {**auth, "x-request-id": "r3"}) == (
            405,
            "r3",
        )
        streamed = {**auth, "x-request-id": "r4"}
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
        try:
            body = json.dumps({"model": "engined", "prompt": [1], "max_tokens": 2, "stream": True})
            connection.request(
                "POST",
                "/v1/completions",
                body=body,
                headers={"content-type": "application/json", **streamed},
            )
            reply = connection.getresponse()
            assert (reply.status, reply.getheader("x-request-id")) == (200, "r4")
            assert reply.read().endswith(b"data: [DONE]\n\n")
        finally:
            connection.close()


def test_without_the_flag_there_is_none(tmp_path: Path) -> None:
    with start_api(tmp_path, "--speedup-ratio", "0") as api:
        assert exchange(api.port, "POST", "/v1/completions", {"x-request-id": "abc"}) == (
            200,
            None,
        )
