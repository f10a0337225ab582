"""The OpenAI API server processes of `engined serve`, started and watched by the daemon.

vLLM runs its API servers in processes of their own that talk to the engine core over
ZeroMQ; engined does the same, so HTTP parsing, tokenization and JSON never run on the loop
that paces the ranks. The daemon binds the listening socket itself, once (a port in use is
then one start-up failure, named, before any child exists), and each child inherits it and
accepts from it: the kernel spreads connections over the children. A child is an ordinary
control client (`python -m engined.openai`); it gets the configuration on its stdin, never
on its command line, since it holds the API keys.

A child that dies while the daemon serves ends the daemon non-zero, as a rank worker does
(and as vLLM's API server supervisor does): a supervisor restarts the pair. At shutdown the
children are asked to stop first (SIGTERM: they stop accepting and finish their streams
while the daemon drains), then waited for, then killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
import socket
import sys

import msgspec
import structlog

from engined.admission_counters import AdmissionCounters
from engined.config import DaemonConfig

log = structlog.get_logger(__name__)

# vLLM's uvicorn listens with a backlog of 2048 (its default); so does engined.
LISTEN_BACKLOG = 2048
# How long a child may take to exit once the daemon has drained, before it is killed.
EXIT_GRACE_S = 5.0
# How long a child may take to load its tokenizer, connect and say it is ready.
READY_TIMEOUT_S = 60.0
# What a child writes on its stdout once it accepts connections.
READY_LINE = b"ready\n"


class ApiServerDied(RuntimeError):
    """An API server process ended while the daemon was serving."""


def listening_socket(host: str, port: int) -> socket.socket:
    """Bind and listen as vLLM does: every IPv4 interface for "", IPv6 for an IPv6 address.

    Raises:
        OSError: the address is in use or cannot be bound (a start-up failure).
    """
    family = socket.AF_INET
    with contextlib.suppress(ValueError):
        if ipaddress.ip_address(host.strip("[]")).version == 6:
            family = socket.AF_INET6
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(LISTEN_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


class ApiServers:
    """`config.api_server_count` children serving the OpenAI API on one listening socket."""

    def __init__(self, config: DaemonConfig) -> None:
        assert config.api_port is not None
        self._config = config
        self._sock: socket.socket | None = None
        self._children: list[asyncio.subprocess.Process] = []
        self._stopping = False
        # Shared with every child, which writes its own slot (engined.admission_counters).
        self.counters = AdmissionCounters.create(config.api_server_count)

    @property
    def port(self) -> int:
        assert self._sock is not None
        return int(self._sock.getsockname()[1])

    @property
    def pids(self) -> list[int]:
        return [child.pid for child in self._children]

    async def start(self) -> None:
        """Bind, then start every child; raises OSError when the port cannot be bound."""
        config = self._config
        assert config.api_port is not None
        self._sock = listening_socket(config.api_host, config.api_port)
        fd = self._sock.fileno()
        counters_fd = self.counters.fd
        payload = msgspec.json.encode(config)
        for index in range(config.api_server_count):
            child = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "engined.openai",
                "--listen-fd",
                str(fd),
                "--index",
                str(index),
                "--parent-pid",
                str(os.getpid()),
                "--counters-fd",
                str(counters_fd),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                pass_fds=(fd, counters_fd),
            )
            self._children.append(child)
            assert child.stdin is not None
            child.stdin.write(payload)
            await child.stdin.drain()
            child.stdin.close()
        for child in self._children:
            await self._ready(child)
        log.info(
            "api servers started",
            host=config.api_host or "0.0.0.0",
            port=self.port,
            processes=self.pids,
        )

    async def _ready(self, child: asyncio.subprocess.Process) -> None:
        """Wait for the child's ready line; OSError (a start-up failure) if it never comes."""
        assert child.stdout is not None
        try:
            line = await asyncio.wait_for(child.stdout.readline(), READY_TIMEOUT_S)
        except TimeoutError:
            raise OSError(
                f"api server process {child.pid} was not ready within {READY_TIMEOUT_S:.0f} s"
            ) from None
        if line != READY_LINE:
            code = await child.wait()
            raise OSError(f"api server process {child.pid} exited with {code} while starting")

    async def watch(self) -> None:
        """Return never while serving; raise ApiServerDied when a child ends unasked."""
        waits = [asyncio.ensure_future(child.wait()) for child in self._children]
        try:
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for wait in waits:
                wait.cancel()
        if self._stopping:
            await asyncio.Event().wait()
        ended = [child for child in self._children if child.returncode is not None]
        raise ApiServerDied(
            "api server process "
            + ", ".join(f"{child.pid} exited with {child.returncode}" for child in ended)
        )

    def stop(self) -> None:
        """Ask every child to stop accepting and finish its requests (SIGTERM)."""
        self._stopping = True
        for child in self._children:
            if child.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    child.send_signal(signal.SIGTERM)

    async def close(self) -> None:
        """Stop the children (killing those that outlive EXIT_GRACE_S) and the socket."""
        self.stop()
        for child in self._children:
            try:
                await asyncio.wait_for(child.wait(), EXIT_GRACE_S)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    child.kill()
                await child.wait()
            if child.returncode not in (0, None):
                log.warning("api server exited", pid=child.pid, code=child.returncode)
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self.counters.close()
