"""asyncio client of the control protocol (v1), used by the CLI, the tests and the benchmarks.

`api` holds `EngineClient`'s calls (the handoff ones in `handoff_calls`), `dealer_connection` its
socket and reader, `mailboxes` who waits for what the daemon sends, `liveness` how a lost or
restarted daemon is noticed, `client_errors` what the calls raise.
"""

from engined.client.api import EngineClient, Generation
from engined.client.client_errors import (
    ClientClosedError,
    ConnectionRefused,
    DaemonLost,
    EngineError,
    ProtocolError,
)
from engined.client.dealer_connection import DEFAULT_TIMEOUT
from engined.client.liveness import (
    DEFAULT_LIVENESS_S,
    ConnectionBack,
    ConnectionEvent,
    ConnectionLost,
)
from engined.client.mailboxes import LIFECYCLE_FEED_SIZE

__all__ = [
    "DEFAULT_LIVENESS_S",
    "DEFAULT_TIMEOUT",
    "LIFECYCLE_FEED_SIZE",
    "ClientClosedError",
    "ConnectionBack",
    "ConnectionEvent",
    "ConnectionLost",
    "ConnectionRefused",
    "DaemonLost",
    "EngineClient",
    "EngineError",
    "Generation",
    "ProtocolError",
]
