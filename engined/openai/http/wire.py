"""Response heads and chunk framing, encoded once per response with no per-header objects.

A streamed completion writes one chunk per token, so the framing is a single `%`-format of
bytes; the head is built once per response. Handlers' header names and values are checked
for CR and LF here, so that no app bug can split a response.
"""

from __future__ import annotations

import time
from email.utils import formatdate
from http import HTTPStatus

import structlog

from engined.openai.http.http_messages import ErrorFactory, HttpResponse

log = structlog.get_logger(__name__)

_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
LAST_CHUNK = b"0\r\n\r\n"

_date_second = -1
_date_header = b""


def _date() -> bytes:
    """RFC 9110's Date header, formatted once a second (a response costs a clock read)."""
    global _date_second, _date_header
    now = int(time.time())
    if now != _date_second:
        _date_second = now
        _date_header = b"date: " + formatdate(now, usegmt=True).encode() + b"\r\n"
    return _date_header


def head(
    status: int,
    content_type: str,
    headers: tuple[tuple[str, str], ...],
    *,
    length: int | None,
    close: bool,
    keep_alive_10: bool = False,
) -> bytes:
    """The status line and headers. `length` None: chunked, unless `close` delimits the body.
    An empty `content_type` sends none (a Starlette `Response` without a media type).

    Raises ValueError for a header that could split the response (CR or LF, non-latin-1).
    """
    parts = [b"HTTP/1.1 %d %b\r\n" % (status, _REASONS.get(status, b"Unknown")), _date()]
    if content_type:
        parts.append(b"content-type: " + _field(content_type) + b"\r\n")
    if length is not None:
        parts.append(b"content-length: %d\r\n" % length)
    elif not close:
        parts.append(b"transfer-encoding: chunked\r\n")
    parts.extend(_field(name) + b": " + _field(value) + b"\r\n" for name, value in headers)
    if close:
        parts.append(b"connection: close\r\n")
    elif keep_alive_10:
        parts.append(b"connection: keep-alive\r\n")
    parts.append(b"\r\n")
    return b"".join(parts)


def _field(text: str) -> bytes:
    if "\r" in text or "\n" in text:
        raise ValueError(f"header text with CR or LF: {text[:64]!r}")
    return text.encode("latin-1")


def chunk(data: bytes) -> bytes:
    """One chunk of a chunked body (never empty: an empty chunk would end the body)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


def fallback(status: int, message: str) -> HttpResponse:
    """What the server sends when the app's error factory itself fails."""
    return HttpResponse(status, message.encode("utf-8", "replace"), "text/plain; charset=utf-8")


def error_response(factory: ErrorFactory, status: int, message: str) -> HttpResponse:
    """The app's error for a refusal of the server; a factory that fails costs the shape only."""
    try:
        response = factory(status, message)
        if isinstance(response, HttpResponse):
            return response
    except Exception:
        log.exception("http error factory failed", status=status)
    return fallback(status, message)


def error_bytes(factory: ErrorFactory, status: int, message: str, close: bool = True) -> bytes:
    """A whole error response, head and body."""
    response = error_response(factory, status, message)
    try:
        error_head = head(
            response.status,
            response.content_type,
            response.headers,
            length=len(response.body),
            close=close,
        )
    except ValueError:
        response = fallback(status, message)
        error_head = head(status, response.content_type, (), length=len(response.body), close=close)
    return error_head + response.body
