"""The one exception the wire layer raises, and the protocol's error codes.

Decoders turn every malformed input into `WireError` so a reader loop needs one `except`
clause, and so the server can answer with the code as is. `msgspec` exceptions never escape.
"""

from __future__ import annotations

from typing import Literal

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
]


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
    message_id
        The client's `id`, when it could still be read from the broken message, so the daemon
        can copy it into the `error` reply as it does for every direct reply.
    """

    def __init__(
        self, code: ErrorCode, message: str, *, message_id: int | str | None = None
    ) -> None:
        super().__init__(message)
        self.code: ErrorCode = code
        self.message = message
        self.message_id = message_id

    def __repr__(self) -> str:
        return f"WireError({self.code!r}, {self.message!r})"
