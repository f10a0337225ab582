"""vLLM's CORS flags, answered as Starlette 1.10's CORSMiddleware answers them.

`starlette_1_10_cors.json` holds what the real middleware (Starlette 1.10, vLLM 0.33's) gave
a FastAPI app added with vLLM's arguments (`allow_origins=--allowed-origins`,
`allow_credentials`, `allow_methods`, `allow_headers`), recorded with its TestClient, for six
settings (vLLM's defaults; one origin; `*`; `*` with credentials; two origins, two methods
and two headers with credentials; a lower-case method and no headers) and fifteen requests
each (preflights from an allowed and another origin, for listed and unlisted methods and
headers, private network; answers with and without `Origin`, with a cookie; an OPTIONS that
asks no method). Each must get the same status, body and CORS headers here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from engined.openai.cors import CorsPolicy
from engined.openai.http.http_messages import HttpRequest, HttpResponse, StreamingResponse

RECORDED = json.loads((Path(__file__).parent / "starlette_1_10_cors.json").read_text())
CORS = (
    "vary",
    "access-control-allow-origin",
    "access-control-allow-methods",
    "access-control-max-age",
    "access-control-allow-headers",
    "access-control-allow-credentials",
    "access-control-allow-private-network",
    "access-control-expose-headers",
)


def policy(settings: dict[str, Any]) -> CorsPolicy:
    return CorsPolicy(
        settings["allowed_origins"],
        settings["allowed_methods"],
        settings["allowed_headers"],
        settings["allow_credentials"],
    )


def request(method: str, headers: dict[str, str]) -> HttpRequest:
    return HttpRequest(method, "/x", "", headers, b"", "127.0.0.1:1")


def cors_headers(reply: HttpResponse | StreamingResponse) -> dict[str, str]:
    got = dict(reply.headers)
    return {name: got[name] for name in CORS if name in got}


def test_the_recording_covers_every_setting_and_request() -> None:
    assert RECORDED["starlette"] == "1.10.0"
    assert len(RECORDED["cases"]) == 6 * 15


@pytest.mark.parametrize("case", RECORDED["cases"])
def test_answers_are_starlettes(case: dict[str, Any]) -> None:
    cors = policy(case["settings"])
    sent = request(case["method"], case["headers"])
    answer = cors.preflight(sent)
    if case["preflight"]:
        assert answer is not None
        assert (answer.status, answer.body.decode(), answer.content_type) == (
            case["status"],
            case["body"],
            case["content_type"],
        )
        assert cors_headers(answer) == case["cors"]
    else:
        assert answer is None
        routed = cors.answer(sent, HttpResponse(200, b"{}"))
        assert cors_headers(routed) == case["cors"]


def test_an_answers_own_vary_is_kept_before_origin() -> None:
    """Starlette joins the app's Vary values and `Origin` into one header."""
    cors = CorsPolicy(["https://a.example"])
    reply = HttpResponse(200, headers=(("vary", "Accept-Encoding"), ("x-other", "1")))
    answered = cors.answer(request("GET", {"origin": "https://a.example"}), reply)
    assert answered.headers == (
        ("x-other", "1"),
        ("access-control-allow-origin", "https://a.example"),
        ("vary", "Accept-Encoding, Origin"),
    )
