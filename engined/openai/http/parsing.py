"""Requests out of bytes: llhttp (through httptools) with the head and body bounds applied.

llhttp is strict (RFC 9112: one Content-Length, no Content-Length beside Transfer-Encoding,
well-formed chunks, token methods and header names), which is what keeps a request from being
read two ways. What llhttp does not bound, this does: head bytes and header lines (431),
body bytes (413, a declared length refused before any of the body is read). The reader is
fed at most 4 KiB at a time and stops once a request is complete, so a pipelining client
never makes it hold more than the few requests one slice can carry.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal
from urllib.parse import unquote

import httptools

from engined.openai.http.http_messages import HttpRequest
from engined.openai.http.limits import HttpLimits

FEED_SLICE = 4 * 1024
Phase = Literal["wait", "head", "body", "dead"]


class Refusal(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass(slots=True)
class Item:
    """A parsed request to answer, or the refusal that ends the connection."""

    request: HttpRequest | None
    refusal: Refusal | None = None
    keep_alive: bool = False
    http10: bool = False


class RequestReader:
    """The parsing state of one connection.

    `phase` says what the client owes: "wait" (no request begun), "head", "body", or "dead"
    (nothing more is parsed: a refusal, `Connection: close`, or the connection going away);
    `phase_since` when the head or body began (the connection's deadlines run from it).
    """

    def __init__(self, limits: HttpLimits, clock: Callable[[], float]) -> None:
        self._limits = limits
        self._clock = clock
        self._parser = httptools.HttpRequestParser(self)
        self.peer = ""
        self.phase: Phase = "wait"
        self.phase_since = clock()
        self.items: collections.deque[Item] = collections.deque()
        self.continue_due = False
        self._url: list[bytes] = []
        self._headers: list[tuple[bytes, bytes]] = []
        self._head_bytes = 0
        self._raw_head_bytes = 0
        self._body = bytearray()
        self._body_bytes = 0
        self._head: tuple[str, str, bool, dict[str, str]] = ("", "", False, {})
        self._refusal: Refusal | None = None

    def feed(self, data: memoryview) -> int:
        """Parse `data` until a request is complete (or the reader dies); bytes consumed."""
        offset = 0
        size = len(data)
        while offset < size and not self.items and self.phase != "dead":
            piece = data if size <= FEED_SLICE else data[offset : offset + FEED_SLICE]
            offset += len(piece)
            try:
                self._parser.feed_data(piece)
            except httptools.HttpParserUpgrade:
                # Nothing here speaks another protocol: the request is answered, then closed.
                if self.items and self.items[-1].request is not None:
                    self.items[-1].keep_alive = False
                    self.phase = "dead"
                else:
                    self.fail(Refusal(400, "Invalid HTTP request received: upgrade"))
            except httptools.HttpParserError as exc:
                self.fail(self._refusal or Refusal(400, f"Invalid HTTP request received: {exc}"))
            if self.phase == "head":
                # llhttp gathers a header line before calling back: this bounds a line that
                # never ends, within a slice of the exact bound the callbacks keep.
                self._raw_head_bytes += len(piece)
                if self._raw_head_bytes > self._limits.max_head_bytes + FEED_SLICE:
                    self.fail(self._too_large_head())
        return offset

    def fail(self, refusal: Refusal) -> None:
        self.items.append(Item(None, refusal))
        self.phase = "dead"

    def _refuse(self, status: int, message: str) -> Refusal:
        self._refusal = Refusal(status, message)
        return self._refusal

    def _too_large_head(self) -> Refusal:
        return self._refuse(
            431, f"Request header fields too large (limit {self._limits.max_head_bytes} bytes)"
        )

    # httptools callbacks: an exception raised here becomes an HttpParserCallbackError.

    def on_message_begin(self) -> None:
        self.phase = "head"
        self.phase_since = self._clock()
        self._url.clear()
        self._headers.clear()
        self._body.clear()
        self._head_bytes = self._raw_head_bytes = self._body_bytes = 0

    def on_url(self, url: bytes) -> None:
        self._url.append(url)
        self._head_bytes += len(url)
        if self._head_bytes > self._limits.max_head_bytes:
            raise self._too_large_head()

    def on_header(self, name: bytes, value: bytes) -> None:
        headers = self._headers
        headers.append((name, value))
        self._head_bytes += len(name) + len(value) + 4
        if self._head_bytes > self._limits.max_head_bytes:
            raise self._too_large_head()
        if len(headers) > self._limits.max_headers:
            raise self._refuse(
                431, f"Request header fields too large (limit {self._limits.max_headers} headers)"
            )

    def on_headers_complete(self) -> None:
        self.phase = "body"
        self.phase_since = self._clock()
        headers: dict[str, str] = {}
        for raw_name, raw_value in self._headers:
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            if name in headers:
                value = f"{headers[name]}, {value}"
            headers[name] = value
        method = self._parser.get_method().decode("ascii")
        version = self._parser.get_http_version()
        self._head = (method, version, self._parser.should_keep_alive(), headers)
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self._limits.max_body_bytes:
            raise self._refuse(
                413, f"Request body too large (limit {self._limits.max_body_bytes} bytes)"
            )
        self.continue_due = version == "1.1" and headers.get("expect", "").lower() == "100-continue"

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        if self._body_bytes > self._limits.max_body_bytes:
            raise self._refuse(
                413, f"Request body too large (limit {self._limits.max_body_bytes} bytes)"
            )
        self._body += body

    def on_message_complete(self) -> None:
        method, version, keep_alive, headers = self._head
        path, query = self._target(b"".join(self._url))
        request = HttpRequest(method, path, query, headers, bytes(self._body), self.peer)
        self.items.append(Item(request, keep_alive=keep_alive, http10=version == "1.0"))
        self._body.clear()
        self.continue_due = False
        self.phase = "wait" if keep_alive else "dead"

    def _target(self, raw: bytes) -> tuple[str, str]:
        """(percent-decoded path, raw query) of the request target; llhttp checked its bytes."""
        try:
            if raw.startswith(b"/") and b"#" not in raw:
                path, _, query = raw.decode("ascii").partition("?")
            else:  # absolute form (or a fragment): let the URL parser take it apart
                url = httptools.parse_url(raw)
                path = url.path.decode("ascii") if url.path else "/"
                query = url.query.decode("ascii") if url.query else ""
        except (httptools.HttpParserInvalidURLError, UnicodeDecodeError):
            raise self._refuse(400, "Invalid HTTP request received: bad request target") from None
        return (unquote(path) if "%" in path else path), query
