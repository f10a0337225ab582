"""The bounds of the API server's HTTP layer, each with what a client meets at it.

Every read the server waits for has a deadline, every byte it buffers for a client has a
ceiling, and every client has one request in flight, so that no client (slow, huge, idle or
hostile) holds memory or a connection slot for long, and none can slow another's stream.
The README's "Limits and guarantees" table states each one.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class HttpLimits:
    """Defaults are vLLM 0.33's figures where it has one (keep-alive 5 s, 256 headers).

    Attributes:
        max_head_bytes: request line and headers; beyond them 431 and the connection closes.
            vLLM's uvicorn allows h11 4 MB "events", meant for bodies too; no OpenAI client
            sends more than a few KiB of head, and 64 KiB held by each of thousands of
            connections stays within a few hundred MB.
        max_headers: header lines in one head (vLLM's `h11_max_header_count`); beyond, 431.
        max_body_bytes: a request body, Content-Length or chunked; beyond, 413 and the
            connection closes. A declared length beyond it is refused before any of the body
            is read. vLLM (uvicorn) sets none: 32 MiB holds a prompt of millions of tokens.
        head_timeout_s: from a request's first byte to the end of its head; then 408 and close
            (slowloris: a client dribbling a head is told why, then dropped).
        body_timeout_s: from the end of the head to the end of the body; then 408 and close.
        keep_alive_s: a connection with no request begun (fresh, or between requests) is
            closed after this long, silently, as uvicorn does (vLLM's `timeout_keep_alive`).
        write_timeout_s: a response whose writes stall this long (the client reads nothing)
            is abandoned: the connection is cut and a stream's iterator aclose()d.
        max_connections: connections open at once in this process; one more is answered 503
            and closed (at most the descriptor limit less 64).
    """

    max_head_bytes: int = 64 * 1024
    max_headers: int = 256
    max_body_bytes: int = 32 * 1024 * 1024
    head_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0
    write_timeout_s: float = 30.0
    max_connections: int = 4096

    def __post_init__(self) -> None:
        for name in ("max_head_bytes", "max_headers", "max_body_bytes", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"HttpLimits.{name} must be at least 1")
        for name in ("head_timeout_s", "body_timeout_s", "keep_alive_s", "write_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"HttpLimits.{name} must be positive")
