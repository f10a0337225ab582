"""CORS as `vllm serve` answers it: Starlette's CORSMiddleware with vLLM's default settings.

vLLM adds the middleware with `--allowed-origins` empty ("cross-origin browser access is
disabled by default"), `--allowed-methods` and `--allowed-headers` `["*"]` and
`--allow-credentials` off (entrypoints/serve/middleware/register.py), inside its
authentication (which lets every OPTIONS through). So a preflight (OPTIONS with `Origin` and
`Access-Control-Request-Method`) is refused without routing: 400 `Disallowed CORS origin`,
with `, method` for a method Starlette does not list (compared case-sensitively) and
`, private-network` for a private-network request; and every other answer gets `Vary:
Origin` and no `Access-Control-Allow-Origin`, so a browser keeps it from a page of another
origin. The authentication's 401 gets nothing, as it never reaches the middleware. Starlette
1.10's values, as vLLM 0.33 installs it. engined reads the four flags and ignores them (a
warning names them): it answers as vLLM's defaults do.
"""

from __future__ import annotations

import dataclasses
from typing import Final

from engined.openai.http.http_messages import HttpRequest, HttpResponse, StreamingResponse

Reply = HttpResponse | StreamingResponse

# Starlette's ALL_METHODS, what `allow_methods=["*"]` allows.
_METHODS: Final = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")
_PREFLIGHT: Final = (
    (
        "vary",
        "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, "
        "Access-Control-Request-Private-Network",
    ),
    ("access-control-allow-methods", ", ".join(_METHODS)),
    ("access-control-max-age", "600"),
)
_SIMPLE: Final = (("vary", "Origin"),)


def preflight(request: HttpRequest) -> HttpResponse | None:
    """The answer to a CORS preflight, or None when `request` is not one."""
    headers = request.headers
    method = headers.get("access-control-request-method")
    if request.method != "OPTIONS" or method is None or "origin" not in headers:
        return None
    answer = list(_PREFLIGHT)
    requested = headers.get("access-control-request-headers")
    if requested is not None:
        # `allow_headers=["*"]`: whatever is asked for is mirrored back.
        answer.append(("access-control-allow-headers", requested))
    # No origin is allowed.
    failures = ["origin"]
    if method not in _METHODS:
        failures.append("method")
    if "access-control-request-private-network" in headers:
        failures.append("private-network")
    text = "Disallowed CORS " + ", ".join(failures)
    return HttpResponse(
        400, text.encode(), content_type="text/plain; charset=utf-8", headers=tuple(answer)
    )


def with_cors(reply: Reply) -> Reply:
    """`reply` with what Starlette's middleware adds to an answer that is no preflight."""
    return dataclasses.replace(reply, headers=(*reply.headers, *_SIMPLE))
