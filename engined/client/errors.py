"""What `EngineClient` calls raise besides TimeoutError."""

from __future__ import annotations

from engined.wire.control import ErrorCode


class EngineError(Exception):
    """The daemon answered `error`.

    Attributes:
        code: the protocol error code (`bad_message`, `duplicate_request`, ...).
        message: the daemon's human-readable message, naming the offending field.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code: ErrorCode = code
        self.message = message


class ProtocolError(RuntimeError):
    """The daemon answered with a reply of the wrong type for the message sent."""


class ClientClosedError(ConnectionError):
    """The client was closed, or its reader failed (the failure is the `__cause__`)."""
