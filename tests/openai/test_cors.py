"""CORS as `vllm serve` answers it (Starlette's CORSMiddleware with vLLM's default settings,
inside its authentication), against a real `engined serve` with an API key. The expected
headers and bodies are those Starlette 1.10 (vLLM 0.33's) gives a FastAPI app with the same
middleware settings, recorded with its TestClient."""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator

import pytest

from tests.openai.api_harness import ApiDaemon, start_api

KEY = "secret"
AUTH = {"authorization": f"Bearer {KEY}"}
ORIGIN = {"origin": "http://a.example"}
CORS = ("vary", "access-control-allow-origin", "access-control-allow-methods")
CORS_ALL = (*CORS, "access-control-max-age", "access-control-allow-headers")
PREFLIGHT_VARY = (
    "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, "
    "Access-Control-Request-Private-Network"
)
METHODS = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT, QUERY"


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
        return reply.status, {k: got[k] for k in CORS_ALL if k in got}, reply.read()
    finally:
        connection.close()


def preflight_headers(**more: str) -> dict[str, str]:
    return {
        "vary": PREFLIGHT_VARY,
        "access-control-allow-origin": "*",
        "access-control-allow-methods": METHODS,
        "access-control-max-age": "600",
        **more,
    }


def test_a_preflight_is_answered_without_a_key(api: ApiDaemon) -> None:
    asked = {**ORIGIN, "access-control-request-method": "POST"}
    wanted = {**asked, "access-control-request-headers": "content-type, authorization"}
    assert exchange(api, "OPTIONS", "/v1/completions", wanted) == (
        200,
        preflight_headers(**{"access-control-allow-headers": "content-type, authorization"}),
        b"OK",
    )
    assert exchange(api, "OPTIONS", "/v1/completions", asked) == (200, preflight_headers(), b"OK")
    # Any path: the middleware answers before routing.
    assert exchange(api, "OPTIONS", "/nowhere", asked)[0] == 200


@pytest.mark.parametrize(
    ("more", "text"),
    [
        ({"access-control-request-method": "PURGE"}, b"Disallowed CORS method"),
        ({"access-control-request-method": "post"}, b"Disallowed CORS method"),
        (
            {
                "access-control-request-method": "GET",
                "access-control-request-private-network": "true",
            },
            b"Disallowed CORS private-network",
        ),
        (
            {
                "access-control-request-method": "X",
                "access-control-request-private-network": "true",
            },
            b"Disallowed CORS method, private-network",
        ),
    ],
)
def test_a_refused_preflight_is_starlettes_400(
    api: ApiDaemon, more: dict[str, str], text: bytes
) -> None:
    assert exchange(api, "OPTIONS", "/v1/completions", {**ORIGIN, **more}) == (
        400,
        preflight_headers(),
        text,
    )


def test_other_answers_carry_the_simple_headers(api: ApiDaemon) -> None:
    body = {"model": "engined", "prompt": [1, 2], "max_tokens": 2}
    simple = {"access-control-allow-origin": "*", "vary": "Origin"}
    status, headers, _ = exchange(api, "POST", "/v1/completions", {**AUTH, **ORIGIN}, body)
    assert (status, headers) == (200, simple)
    streamed = {**body, "stream": True}
    status, headers, text = exchange(api, "POST", "/v1/completions", {**AUTH, **ORIGIN}, streamed)
    assert (status, headers) == (200, simple) and text.endswith(b"data: [DONE]\n\n")
    assert exchange(api, "GET", "/nowhere", ORIGIN)[:2] == (404, simple)
    # Not a preflight (no method asked): routed, and the route has no OPTIONS.
    assert exchange(api, "OPTIONS", "/v1/completions", ORIGIN)[:2] == (405, simple)
    # No Origin: only Vary.
    assert exchange(api, "GET", "/health", {})[:2] == (200, {"vary": "Origin"})
    # The authentication answers before the middleware: nothing added.
    assert exchange(api, "POST", "/v1/completions", ORIGIN, body)[:2] == (401, {})
