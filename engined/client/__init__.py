"""asyncio client of the control protocol (v1), used by the CLI, the tests and the benchmarks.

`api` holds `EngineClient`'s calls, `connection` its socket, reader and bookkeeping,
`errors` what the calls raise.
"""

from engined.client.api import EngineClient, Generation
from engined.client.connection import DEFAULT_TIMEOUT, LIFECYCLE_FEED_SIZE
from engined.client.errors import (
    ClientClosedError,
    ConnectionRefused,
    EngineError,
    ProtocolError,
)

__all__ = [
    "DEFAULT_TIMEOUT",
    "LIFECYCLE_FEED_SIZE",
    "ClientClosedError",
    "ConnectionRefused",
    "EngineClient",
    "EngineError",
    "Generation",
    "ProtocolError",
]
