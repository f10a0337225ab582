"""CORS as `vllm serve` answers it: Starlette's CORSMiddleware with vLLM's settings.

vLLM adds the middleware with `--allowed-origins` (empty by default: "cross-origin browser
access is disabled by default"), `--allowed-methods` and `--allowed-headers` (`["*"]`) and
`--allow-credentials` (off) (entrypoints/serve/middleware/register.py), inside its
authentication, which lets every OPTIONS through; the authentication's 401 never reaches
it. Starlette 1.10's rules, as vLLM 0.33 installs it:

* A preflight (OPTIONS with `Origin` and `Access-Control-Request-Method`) is answered
  without routing: 200 `OK`, or 400 `Disallowed CORS` and what failed (`origin`, a `method`
  not listed, compared case-sensitively, requested `headers` not listed, compared
  case-insensitively, `private-network`, never allowed), with the preflight headers: the
  methods, a max age of 600, the listed headers (the CORS-safelisted ones added, sorted;
  with `*` the requested ones mirrored), credentials, and the origin itself when it is
  allowed and named (any origin with `*`, unless credentials are allowed).
* Every other answer of a request with `Origin` gets `Access-Control-Allow-Origin: *` under
  `*` (the origin itself with credentials), the origin when it is listed, and
  `Access-Control-Allow-Credentials` with credentials; every answer otherwise gets `Vary:
  Origin`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Final

from engined.openai.http.http_messages import HttpRequest, HttpResponse, StreamingResponse

Reply = HttpResponse | StreamingResponse

# Starlette's ALL_METHODS, what `allow_methods=["*"]` allows.
_METHODS: Final = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")
# Starlette's SAFELISTED_HEADERS, always listed.
_SAFELISTED: Final = frozenset(("Accept", "Accept-Language", "Content-Language", "Content-Type"))
_PREFLIGHT_VARY: Final = (
    "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, "
    "Access-Control-Request-Private-Network"
)


class CorsPolicy:
    """One server's CORS settings (vLLM's four flags), answering as Starlette does."""

    __slots__ = (
        "_all_headers",
        "_all_origins",
        "_credentials",
        "_explicit",
        "_headers",
        "_methods",
        "_origins",
        "_preflight",
        "_simple",
    )

    def __init__(
        self,
        origins: Sequence[str] = (),
        methods: Sequence[str] = ("*",),
        headers: Sequence[str] = ("*",),
        credentials: bool = False,
    ) -> None:
        listed_methods = _METHODS if "*" in methods else tuple(methods)
        self._all_origins = "*" in origins
        self._origins = frozenset(origins)
        self._methods = frozenset(listed_methods)
        self._all_headers = "*" in headers
        listed_headers = sorted(_SAFELISTED | set(headers))
        self._headers = frozenset(header.lower() for header in listed_headers)
        self._credentials = credentials
        # Whether an allowed origin is named rather than answered with `*`.
        self._explicit = not self._all_origins or credentials
        preflight = [("vary", _PREFLIGHT_VARY)]
        if not self._explicit:
            preflight.append(("access-control-allow-origin", "*"))
        preflight.append(("access-control-allow-methods", ", ".join(listed_methods)))
        preflight.append(("access-control-max-age", "600"))
        if not self._all_headers:
            preflight.append(("access-control-allow-headers", ", ".join(listed_headers)))
        if credentials:
            preflight.append(("access-control-allow-credentials", "true"))
        self._preflight = tuple(preflight)
        simple = []
        if self._all_origins:
            simple.append(("access-control-allow-origin", "*"))
        if credentials:
            simple.append(("access-control-allow-credentials", "true"))
        self._simple = tuple(simple)

    def _allows(self, origin: str) -> bool:
        return self._all_origins or origin in self._origins

    def preflight(self, request: HttpRequest) -> HttpResponse | None:
        """The answer to a CORS preflight, or None when `request` is not one."""
        headers = request.headers
        origin = headers.get("origin")
        method = headers.get("access-control-request-method")
        if request.method != "OPTIONS" or origin is None or method is None:
            return None
        answer = list(self._preflight)
        failures: list[str] = []
        if not self._allows(origin):
            failures.append("origin")
        elif self._explicit:
            answer.append(("access-control-allow-origin", origin))
        if method not in self._methods:
            failures.append("method")
        requested = headers.get("access-control-request-headers")
        if requested is not None:
            if self._all_headers:
                answer.append(("access-control-allow-headers", requested))
            elif any(h.strip() not in self._headers for h in requested.lower().split(",")):
                failures.append("headers")
        if "access-control-request-private-network" in headers:
            failures.append("private-network")
        text = "Disallowed CORS " + ", ".join(failures) if failures else "OK"
        return HttpResponse(
            400 if failures else 200,
            text.encode(),
            content_type="text/plain; charset=utf-8",
            headers=tuple(answer),
        )

    def answer(self, request: HttpRequest, reply: Reply) -> Reply:
        """`reply` with what Starlette's middleware adds to an answer that is no preflight."""
        origin = request.headers.get("origin")
        added: list[tuple[str, str]] = []
        if origin is not None:
            added.extend(self._simple)
            # Named: under `*` with credentials (a browser refuses `*` then), or listed.
            if self._credentials if self._all_origins else origin in self._origins:
                added = [h for h in added if h[0] != "access-control-allow-origin"]
                added.append(("access-control-allow-origin", origin))
        vary = [value for name, value in reply.headers if name.lower() == "vary"]
        kept = tuple(h for h in reply.headers if h[0].lower() != "vary")
        added.append(("vary", ", ".join([*vary, "Origin"])))
        return dataclasses.replace(reply, headers=(*kept, *added))
