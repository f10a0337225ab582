"""The idle daemon hands the heap a burst of clients left behind back to the system (issue 21, 4).

1. `trim` reaches glibc's malloc_trim on a glibc system (what the project runs on).
2. `trim_when_idle`, on a scripted clock of checks: it trims once work was done and the
   daemon is idle, not while busy, and not again while nothing new was done.
3. A real daemon in process (short delays): 50 clients submit and vanish without reading;
   once every one is forgotten the daemon trims, with no per-client state left at that
   moment.
"""

from __future__ import annotations

import asyncio
import platform
import signal
from pathlib import Path

import msgspec
import pytest
import zmq
import zmq.asyncio

from engined.server.control import clients
from engined.server.daemon import EXIT_OK, Daemon
from engined.server.ops import heap
from tests.server.support import ipc_config
from tests.support import run, until


def test_trim_reaches_glibc() -> None:
    assert platform.libc_ver()[0] == "glibc"
    assert heap._TRIM is not None
    assert isinstance(heap.trim(), bool)


class Checks:
    """A fake sleep: each call is one check; the scenario says what the daemon looks like."""

    def __init__(self, script: list[tuple[int, bool]]) -> None:
        self.script = script
        self.work = 0
        self.idle = False
        self.trims: list[int] = []

    async def sleep(self, seconds: float) -> None:
        assert seconds == heap.TRIM_CHECK_S
        if not self.script:
            raise asyncio.CancelledError
        self.work, self.idle = self.script.pop(0)


def test_it_trims_once_per_burst_of_work_and_only_when_idle(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checks = Checks(
        [
            (0, True),  # idle since start, nothing done: no trim
            (10, False),  # busy
            (25, False),  # busy
            (25, True),  # idle after work: trim
            (25, True),  # still idle, nothing new: no trim
            (30, True),  # a little work, idle again: trim
            (40, False),
            (40, True),  # trim
        ]
    )

    def recorded() -> bool:
        checks.trims.append(checks.work)
        return True

    monkeypatch.setattr(heap, "trim", recorded)

    async def scenario() -> None:
        with pytest.raises(asyncio.CancelledError):
            await heap.trim_when_idle(lambda: checks.idle, lambda: checks.work, sleep=checks.sleep)

    run(scenario())
    assert checks.trims == [25, 30, 40]


def test_the_daemon_trims_once_vanished_clients_are_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clients, "DROPPED_FORGET_S", 0.2)
    monkeypatch.setattr(clients, "DROPPED_RETRY_MAX_S", 0.05)
    monkeypatch.setattr(heap, "TRIM_CHECK_S", 0.05)
    cfg = ipc_config(tmp_path, 0.0, **{"engine.num_gpu_blocks": 65536, "rank_processes": 0})
    states: list[dict[str, int]] = []

    async def scenario() -> None:
        ready = asyncio.Event()
        daemon = Daemon(cfg, on_ready=lambda _: ready.set())

        def recorded() -> bool:
            assert daemon.control is not None
            states.append(daemon.control.client_state())
            return True

        monkeypatch.setattr(heap, "trim", recorded)
        serving = asyncio.create_task(daemon.serve())
        await asyncio.wait_for(ready.wait(), 30)
        ctx = zmq.asyncio.Context()
        try:
            for n in range(50):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, 10_000)
                sock.connect(cfg.control_endpoint)
                request = {"token_ids": [n + 1] * 16, "max_tokens": 100_000}
                await sock.send(msgspec.msgpack.encode({"type": "submit", "request": request}))
                sock.close()
            await until(lambda: len(states) >= 1, "a trim", timeout=30)
        finally:
            ctx.term()
            daemon.handle_exit(signal.SIGTERM)
            assert await asyncio.wait_for(serving, 30) == EXIT_OK

    run(scenario())
    assert states[0] == dict.fromkeys(states[0], 0)
