"""CORS as `vllm serve` answers it by default (Starlette's CORSMiddleware with vLLM's
settings: no origin allowed, every method and header, no credentials; inside its
authentication), and with its four flags set, against a real `engined serve` with an API
key (every setting's rules: test_cors_policy.py). The expected headers and
bodies are those Starlette 1.10 (vLLM 0.33's) gives a FastAPI app with the same middleware
settings, recorded with its TestClient."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.openai.api_harness import ApiDaemon, start_api
from tests.openai.test_cors_policy import CORS

KEY = "secret"
AUTH = {"authorization": f"Bearer {KEY}"}
ORIGIN = {"origin": "http://a.example"}
PREFLIGHT_VARY = (
    "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, "
    "Access-Control-Request-Private-Network"
)
METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT, QUERY"
SIMPLE = {"vary": "Origin"}


@pytest.fixture(scope="module")
def api(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ApiDaemon]:
    with start_api(
        tmp_path_factory.mktemp("cors"), "--speedup-ratio", "0", "--api-key", KEY
    ) as daemon:
        yield daemon


def exchange(
    api: ApiDaemon, method: str, path: str, headers: dict[str, str], body: object = None
) -> tuple[int, dict[str, str], bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", api.port, timeout=30)
    try:
        payload = None if body is None else json.dumps(body)
        sent = {**headers, **({"content-type": "application/json"} if payload else {})}
        connection.request(method, path, body=payload, headers=sent)
        reply = connection.getresponse()
        got = {name.lower(): value for name, value in reply.getheaders()}
        return reply.status, {k: got[k] for k in CORS if k in got}, reply.read()
    finally:
        connection.close()


def preflight_headers(**more: str) -> dict[str, str]:
    return {
        "vary": PREFLIGHT_VARY,
        "access-control-allow-methods": METHODS,
        "access-control-max-age": "600",
        **more,
    }


@pytest.mark.parametrize(
    ("more", "text", "headers"),
    [
        (
            {
                "access-control-request-method": "POST",
                "access-control-request-headers": "content-type, authorization",
            },
            b"Disallowed CORS origin",
            preflight_headers(**{"access-control-allow-headers": "content-type, authorization"}),
        ),
        ({"access-control-request-method": "POST"}, b"Disallowed CORS origin", preflight_headers()),
        (
            {"access-control-request-method": "PURGE", "access-control-request-headers": "x-odd"},
            b"Disallowed CORS origin, method",
            preflight_headers(**{"access-control-allow-headers": "x-odd"}),
        ),
        (
            {"access-control-request-method": "post"},
            b"Disallowed CORS origin, method",
            preflight_headers(),
        ),
        (
            {
                "access-control-request-method": "GET",
                "access-control-request-private-network": "true",
            },
            b"Disallowed CORS origin, private-network",
            preflight_headers(),
        ),
    ],
)
def test_a_preflight_is_refused_without_a_key(
    api: ApiDaemon, more: dict[str, str], text: bytes, headers: dict[str, str]
) -> None:
    """No origin is allowed: every preflight is Starlette's 400, before any routing."""
    for path in ("/v1/completions", "/nowhere"):
        assert exchange(api, "OPTIONS", path, {**ORIGIN, **more}) == (400, headers, text)


def test_other_answers_vary_by_origin(api: ApiDaemon) -> None:
    body = {"model": "engined", "prompt": [1, 2], "max_tokens": 2}
    status, headers, _ = exchange(api, "POST", "/v1/completions", {**AUTH, **ORIGIN}, body)
    assert (status, headers) == (200, SIMPLE)
    streamed = {**body, "stream": True}
    status, headers, text = exchange(api, "POST", "/v1/completions", {**AUTH, **ORIGIN}, streamed)
    assert (status, headers) == (200, SIMPLE) and text.endswith(b"data: [DONE]\n\n")
    assert exchange(api, "GET", "/nowhere", ORIGIN)[:2] == (404, SIMPLE)
    # Not a preflight (no method asked): routed, and the route has no OPTIONS.
    assert exchange(api, "OPTIONS", "/v1/completions", ORIGIN)[:2] == (405, SIMPLE)
    assert exchange(api, "GET", "/health", {})[:2] == (200, SIMPLE)
    # The authentication answers before the middleware: nothing added.
    assert exchange(api, "POST", "/v1/completions", ORIGIN, body)[:2] == (401, {})


def test_the_cors_flags_open_it_as_vllms_do(tmp_path: Path) -> None:
    """`--allowed-origins '["http://a.example"]' --allow-credentials`, as `vllm serve` takes
    them: that origin's preflight is allowed and named, its answers name it too, another
    origin's preflight is still refused."""
    with start_api(
        tmp_path,
        "--speedup-ratio",
        "0",
        "--api-key",
        KEY,
        "--allowed-origins",
        '["http://a.example"]',
        "--allowed-methods",
        '["GET", "POST"]',
        "--allow-credentials",
    ) as api:
        asked = {"access-control-request-method": "POST"}
        status, headers, text = exchange(api, "OPTIONS", "/v1/completions", {**ORIGIN, **asked})
        assert (status, text) == (200, b"OK")
        assert headers == {
            "vary": PREFLIGHT_VARY,
            "access-control-allow-methods": "GET, POST",
            "access-control-max-age": "600",
            "access-control-allow-credentials": "true",
            "access-control-allow-origin": "http://a.example",
        }
        other = {"origin": "http://b.example", **asked}
        assert exchange(api, "OPTIONS", "/v1/completions", other)[::2] == (
            400,
            b"Disallowed CORS origin",
        )
        body = {"model": "engined", "prompt": [1, 2], "max_tokens": 2}
        status, headers, _ = exchange(api, "POST", "/v1/completions", {**AUTH, **ORIGIN}, body)
        assert (status, headers) == (
            200,
            {
                "vary": "Origin",
                "access-control-allow-origin": "http://a.example",
                "access-control-allow-credentials": "true",
            },
        )
