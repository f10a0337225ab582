"""A real `engined serve` with its OpenAI API server on a loopback port, for the tests.

The daemon runs on ipc endpoints under the test's tmp_path (tests.server.daemon_harness);
`--port` turns its API server on (the test suite's environment turns it off elsewhere).
Ready means the daemon answers `hello` and the API server answers `GET /health` with 200.
"""

from __future__ import annotations

import http.client
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tests.server.daemon_harness import DaemonProcess, start_daemon
from tests.support import free_tcp_port

READY_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class ApiDaemon:
    daemon: DaemonProcess
    port: int

    @property
    def base_url(self) -> str:
        """What the `openai` client takes as `base_url`."""
        return f"http://127.0.0.1:{self.port}/v1"

    def log(self) -> str:
        return self.daemon.log()


def health(port: int) -> int | None:
    """The status of `GET /health`, or None when nothing answers yet."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        connection.request("GET", "/health")
        return connection.getresponse().status
    except OSError:
        return None
    finally:
        connection.close()


@contextmanager
def start_api(
    tmp_path: Path,
    *args: str,
    servers: int = 1,
    env: dict[str, str] | None = None,
    expect_exit: int | None = 0,
    control: str | None = None,
) -> Iterator[ApiDaemon]:
    """`engined serve --port P --host 127.0.0.1 --api-server-count N ARGS...`, ready;
    `control` replaces the ipc control endpoint (a tcp one, say)."""
    port = free_tcp_port()
    flags = ("--port", str(port), "--host", "127.0.0.1", "--api-server-count", str(servers))
    with start_daemon(
        tmp_path, *flags, *args, env=env, expect_exit=expect_exit, control=control
    ) as daemon:
        deadline = time.monotonic() + READY_TIMEOUT_S
        # NOTE: a readiness probe, as a load balancer's: the API processes start after the
        # daemon answers, and nothing else says when they accept.
        while health(port) != 200:
            if daemon.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the API server did not get ready:\n{daemon.log()}")
            time.sleep(0.05)
        yield ApiDaemon(daemon, port)
