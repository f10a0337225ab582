"""One API server process: its configuration, its daemon connection, its HTTP server.

The daemon starts it (engined.server.api_servers) with the listening socket inherited as a
file descriptor and the whole configuration on stdin. It runs its own event loop (uvloop
when importable), connects to the daemon's control endpoint as an ordinary client (and,
for vLLM's development routes, to its operator endpoint), and serves until SIGTERM or
SIGINT: then it stops accepting, lets its streams finish for up to the daemon's
`drain_timeout`, and exits 0. It also ends when the daemon does (Linux's
parent-death signal), so no API server outlives its engine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
from collections.abc import Sequence

import msgspec
import structlog

from engined import event_loop
from engined.admission_counters import AdmissionCounters
from engined.client import EngineClient
from engined.config import DaemonConfig
from engined.config.endpoints import WILDCARD_HOSTS, parse_endpoint
from engined.logs import configure_logging
from engined.wire.control import Welcome

log = structlog.get_logger(__name__)

# How long a process waits for the daemon's `welcome` at start.
CONNECT_TIMEOUT_S = 30.0
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when the daemon dies (Linux); elsewhere the daemon's exit suffices."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:
        # The daemon died before the signal was armed.
        os.kill(os.getpid(), signal.SIGTERM)


def control_target(config: DaemonConfig) -> str:
    """Where a local client reaches the control ROUTER: its endpoint, loopback for a wildcard."""
    endpoint = parse_endpoint(config.control_endpoint)
    if endpoint.scheme == "tcp" and endpoint.where in WILDCARD_HOSTS:
        host = "[::1]" if endpoint.where == "[::]" else "127.0.0.1"
        return f"tcp://{host}:{endpoint.port}"
    return config.control_endpoint


async def operator_connection(
    client: EngineClient, connected_to: str, welcome: Welcome
) -> EngineClient:
    """The connection the development routes send engine-wide commands on.

    Those need the operator role, which the daemon gives the peers of its `operator_endpoint`
    running as its user, as this process does: `client` itself when it already connected
    there (an ipc control endpoint), else a second connection. A daemon that names none
    (CURVE only) leaves `client`, whose commands it refuses `forbidden` unless its key is an
    operator's.
    """
    endpoint = welcome.operator_endpoint
    if endpoint is None or endpoint == connected_to:
        return client
    operator = await EngineClient.connect(endpoint)
    try:
        await operator.hello(timeout=CONNECT_TIMEOUT_S)
    except BaseException:
        await operator.close()
        raise
    return operator


async def serve(config: DaemonConfig, listen_fd: int, index: int, counters_fd: int) -> int:
    # NOTE: imported here so that a bad command line fails before the heavy imports.
    from engined.openai.app import ApiApp
    from engined.openai.http import HttpLimits, HttpServer
    from engined.openai.serving_dev import dev_mode_from_environment
    from engined.openai.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(config.model or None, config.tokenizer or None)
    sock = socket.socket(fileno=listen_fd)
    counters = AdmissionCounters.attach(counters_fd, config.api_server_count, index)
    target = control_target(config)
    client = await EngineClient.connect(target)
    operator: EngineClient | None = None
    try:
        welcome = await client.hello(timeout=CONNECT_TIMEOUT_S)
        if dev_mode_from_environment():
            operator = await operator_connection(client, target, welcome)
        app = ApiApp(
            config=config,
            client=client,
            welcome=welcome,
            tokenizer=tokenizer,
            counters=counters,
            operator=operator,
        )
        server = HttpServer(app.handle, app.error_response, HttpLimits())
        loop = asyncio.get_running_loop()
        stopping: set[asyncio.Task[None]] = set()

        def stop() -> None:
            if not stopping:
                stopping.add(asyncio.create_task(server.shutdown(config.drain_timeout)))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop)
        log.info("api server ready", index=index, pid=os.getpid(), model=app.model_names[0])
        # The daemon waits for this line (engined.server.api_servers); the socket already
        # listens, so connections made meanwhile wait in its backlog.
        sys.stdout.buffer.write(b"ready\n")
        sys.stdout.buffer.flush()
        try:
            await server.serve(sock)
            for task in stopping:
                await task
        finally:
            await app.close()
    finally:
        if operator is not None and operator is not client:
            await operator.close()
        await client.close()
        sock.close()
        counters.close()
    return 0


def main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m engined.openai")
    parser.add_argument("--listen-fd", type=int, required=True)
    parser.add_argument("--index", type=int, default=0)
    parser.add_argument("--counters-fd", type=int, required=True)
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    _die_with_parent(args.parent_pid)
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=DaemonConfig)
    configure_logging(config.log_format, config.log_level)
    return event_loop.run(serve(config, args.listen_fd, args.index, args.counters_fd))
