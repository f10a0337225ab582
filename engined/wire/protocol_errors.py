"""The one exception the wire layer raises, the protocol's error codes, and the echo bound.

Decoders turn every malformed input into `WireError` so a reader loop needs one `except`
clause, and so the server can answer with the code as is. `msgspec` exceptions never escape.

msgspec quotes the offending input in its messages (an unknown key, an unknown `type`), so a
client could make its error reply, and the daemon's log line, as large as its message: a
16 MiB key came back as a 16 MiB reply. Every `WireError` message is therefore bounded on
construction (`bound_message`), which covers every decoder at once.
"""

from __future__ import annotations

import re
from typing import Final, Literal

# Every `code` an `error` reply may carry (protocol v1, section 1.2). The wire layer itself only
# raises the first two; the others come from the core's errors and the daemon's state.
ErrorCode = Literal[
    "bad_message",
    "invalid_request",
    "duplicate_request",
    "unsupported",
    "capacity",
    "overloaded",
    "shutting_down",
    "forbidden",
    "paused",
]

# A quoted piece of client input inside a message keeps at most this many UTF-8 bytes, so the
# path after it (`- at `$.request``) survives; a whole message keeps at most MESSAGE_MAX_BYTES.
ECHO_MAX_BYTES: Final = 128
MESSAGE_MAX_BYTES: Final = 512

# A `...` or '...' span whose content is longer than ECHO_MAX_BYTES could be (4 bytes per
# code point at most, so at least ECHO_MAX_BYTES // 4 characters).
_MIN_LONG: Final = ECHO_MAX_BYTES // 4
_LONG_QUOTED: Final = re.compile(rf"`([^`]{{{_MIN_LONG},}})`|'([^']{{{_MIN_LONG},}})'")


_MARKER: Final = re.compile(r"…\(truncated, \d{1,20} bytes\)$")


def truncate_utf8(text: str, limit: int) -> str:
    """`text` cut to at most `limit` UTF-8 bytes, marked `…(truncated, N bytes)` when cut.

    The cut never splits a character; N is the size of the whole text in UTF-8 bytes. Text
    already cut to the limit is left as it is, so bounding twice changes nothing.
    """
    if len(text) * 4 <= limit:
        return text
    raw = text.encode("utf-8", "surrogatepass")
    if len(raw) <= limit:
        return text
    marker = _MARKER.search(text)
    if marker is not None and len(text[: marker.start()].encode("utf-8", "surrogatepass")) <= limit:
        return text
    kept = raw[:limit].decode("utf-8", "ignore")
    return f"{kept}…(truncated, {len(raw)} bytes)"


def _shorten_quoted(match: re.Match[str]) -> str:
    backquoted = match.group(1)
    if backquoted is not None:
        return f"`{truncate_utf8(backquoted, ECHO_MAX_BYTES)}`"
    return f"'{truncate_utf8(match.group(2), ECHO_MAX_BYTES)}'"


def bound_message(text: str) -> str:
    """A message safe to send back and to log, whatever input it quotes.

    Long quoted input is shortened first, so the message still names the field; the whole
    is then capped, in case the input was not quoted or held quote characters itself.
    """
    if len(text) <= ECHO_MAX_BYTES // 4:
        return text
    return truncate_utf8(_LONG_QUOTED.sub(_shorten_quoted, text), MESSAGE_MAX_BYTES)


class WireError(ValueError):
    """A payload does not follow the wire contract.

    Parameters
    ----------
    code
        `"bad_message"` when the bytes do not have the right shape (not msgpack, not a map,
        unknown type or field, wrong type); `"invalid_request"` when they do but break a value
        rule (empty `token_ids`, a negative `max_tokens`, an id longer than its byte limit).
    message
        Human readable, naming the offending field as a msgspec path (`$.request.token_ids`).
        Bounded by `bound_message`: what it quotes of the input is truncated.
    message_id
        The client's `id`, when it could still be read from the broken message, so the daemon
        can copy it into the `error` reply as it does for every direct reply.
    """

    def __init__(
        self, code: ErrorCode, message: str, *, message_id: int | str | None = None
    ) -> None:
        message = bound_message(message)
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.message_id = message_id

    def __repr__(self) -> str:
        return f"WireError({self.code!r}, {self.message!r})"
