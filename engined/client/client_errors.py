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


class DaemonLost(ClientClosedError):
    """The connection to the daemon dropped, or the daemon stopped answering heartbeats.

    Every call and stream waiting when it happened raises it, and so does every call until
    the daemon is back (`EngineClient.next_connection_event`). Whatever the daemon ran for
    this connection is gone from the client's view: resubmit elsewhere or after the return.
    """


class ConnectionRefused(ConnectionRefusedError):
    """The daemon refused this connection in its handshake (protocol §1.5).

    Attributes:
        status: 400, credentials refused (no CURVE key, or one the daemon does not know);
            500, the daemon is at its connection cap (`max_connections`). ZeroMQ does not
            retry a refused handshake: the client is done, and a new one may try again.
    """

    def __init__(self, status: int) -> None:
        reason = {
            400: "it did not accept this client's credentials (CURVE key)",
            500: "it is at its connection limit (max_connections)",
        }.get(status, "for a reason it did not say")
        super().__init__(f"the daemon refused the connection (ZAP {status}): {reason}")
        self.status = status
