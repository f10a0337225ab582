"""Per-client state is freed with the client's last work, and bounded whatever clients do
(issue 10, defect 10).

In process, so the server's per-identity tables can be counted:

1. 500 short-lived clients, each with a ping, a request read to its end and a disconnect:
   afterwards no identity is tracked, owns anything or watches the load.
2. 120 clients that vanish with a request running, with at most 16 remembered: each is
   dropped once its next output cannot be sent, its request leaves the core, and at most 16
   dropped clients (one notice each) are kept.
3. With room for only 10 notices, the oldest dropped clients are forgotten to make room.
4. 40 `watch_load` clients that vanish: none stays on the watch list once the load changes.
5. A client with a fixed routing id that vanished with a request running and reconnects:
   its first message brings it the request's `cancelled` terminal, then the reply.
6. 300 clients that submit and vanish without reading anything (issue 21, 4): each is
   dropped once and, silent for the (shortened) forget delay, forgotten once; then every
   per-identity table is empty, as are the notices, and the core.

Waits are bounded loops on the server's state or on received messages.
"""

from __future__ import annotations

import asyncio
from collections.abc import MutableMapping
from pathlib import Path
from typing import Any

import msgspec
import pytest
import structlog.testing
import zmq

from engined.client import EngineClient
from engined.server.control import clients, episodes
from engined.wire.control import DaemonMessage, Output, Pong, ReplyDecoder
from tests.server.inprocess import Served, serve
from tests.support import run, until

WAIT_S = 30.0
SCENARIO_TIMEOUT_S = 120.0
DECODER = ReplyDecoder()


def encode(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


async def vanish_with_a_running_request(served: Served, n: int) -> None:
    sock = served.dealer()
    request = {"request_id": f"v{n}", "token_ids": [n % 97 + 1] * 16, "max_tokens": 100_000}
    await sock.send(encode(type="submit", request=request, id=1))
    await sock.recv()  # submitted: the request is owned
    sock.close()


def test_short_lived_clients_leave_nothing_behind(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serve(tmp_path) as served:
            for n in range(500):
                async with await EngineClient.connect(served.endpoint, ctx=served.ctx) as c:
                    await c.ping()
                    generation = await c.generate([n % 97 + 1] * 16, 2)
                    assert generation.finish_reason == "length"
            state = served.control.client_state
            await until(
                lambda: state()["tracked"] == 0, "every client's state freed", timeout=WAIT_S
            )
            assert state() == dict.fromkeys(state(), 0)

    run(scenario(), SCENARIO_TIMEOUT_S)


def test_vanished_clients_are_remembered_up_to_a_bound(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(episodes, "MAX_DROPPED_CLIENTS", 16)

    async def scenario() -> None:
        async with serve(tmp_path, num_gpu_blocks=65536) as served:
            state = served.control.client_state
            for n in range(120):
                await vanish_with_a_running_request(served, n)
                assert state()["dropped"] <= 16
            await until(
                lambda: served.loop.engine.is_empty(), "every request cancelled", timeout=WAIT_S
            )
            assert state()["owning"] == 0
            assert state()["dropped"] == 16
            assert state()["notices"] == 16  # one `cancelled` terminal each
            assert state()["tracked"] == 16

    run(scenario(), SCENARIO_TIMEOUT_S)


def test_notices_beyond_the_budget_evict_the_oldest_dropped_clients(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(episodes, "MAX_NOTICES", 10)

    async def scenario() -> None:
        async with serve(tmp_path, num_gpu_blocks=65536) as served:
            state = served.control.client_state
            for n in range(40):
                await vanish_with_a_running_request(served, n)
            await until(
                lambda: served.loop.engine.is_empty(), "every request cancelled", timeout=WAIT_S
            )
            assert state()["notices"] == 10
            assert state()["dropped"] == 10

    run(scenario(), SCENARIO_TIMEOUT_S)


def test_vanished_load_watchers_are_forgotten(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serve(tmp_path) as served:
            state = served.control.client_state
            for _ in range(40):
                sock = served.dealer()
                await sock.send(encode(type="watch_load", id=1))
                await sock.recv()  # applied
                sock.close()
            assert state()["watching"] == 40
            async with await EngineClient.connect(served.endpoint, ctx=served.ctx) as worker:
                for n in range(200):
                    await worker.generate([n + 1] * 16, 1)
                    if not state()["watching"]:
                        break
            assert state()["watching"] == 0
            assert state()["dropped"] == 40

    run(scenario(), SCENARIO_TIMEOUT_S)


def test_a_client_that_comes_back_learns_its_request_was_cancelled(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with serve(tmp_path, num_gpu_blocks=65536) as served:
            state = served.control.client_state
            first = served.dealer(identity=b"comes-back")
            request = {"request_id": "left", "token_ids": [9] * 16, "max_tokens": 100_000}
            await first.send(encode(type="submit", request=request, id=1))
            await first.recv()
            first.close()
            await until(
                lambda: served.loop.engine.is_empty(), "the request cancelled", timeout=WAIT_S
            )
            assert state()["dropped"] == 1
            again = served.dealer(identity=b"comes-back")
            await again.send(encode(type="ping", id=2))
            seen: list[DaemonMessage] = []
            async with asyncio.timeout(WAIT_S):
                while not any(isinstance(m, Pong) for m in seen):
                    seen.append(DECODER.decode(await again.recv()))
            finals = [
                (e.request_id, e.finish_reason)
                for m in seen
                if isinstance(m, Output)
                for e in m.outputs
                if e.finished
            ]
            assert finals == [("left", "cancelled")]
            assert isinstance(seen[-1], Pong)
            await until(lambda: state()["tracked"] == 0, "its state freed", timeout=WAIT_S)
            assert state()["dropped"] == 0

    run(scenario(), SCENARIO_TIMEOUT_S)


def test_clients_that_vanish_without_reading_are_forgotten(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(clients, "DROPPED_FORGET_S", 0.2)
    monkeypatch.setattr(clients, "DROPPED_RETRY_MAX_S", 0.05)
    vanishing = 300

    async def scenario() -> list[MutableMapping[str, Any]]:
        with structlog.testing.capture_logs() as logs:
            async with serve(tmp_path, num_gpu_blocks=65536) as served:
                state = served.control.client_state
                for n in range(vanishing):
                    sock = served.dealer()
                    sock.setsockopt(zmq.LINGER, 10_000)  # the submit leaves, then it goes
                    request = {"token_ids": [n % 97 + 1] * 16, "max_tokens": 100_000}
                    await sock.send(encode(type="submit", request=request, id=n))
                    sock.close()

                def forgotten() -> int:
                    return sum(e["event"] == "dropped client forgotten" for e in logs)

                await until(
                    lambda: forgotten() == vanishing, "every client forgotten", timeout=WAIT_S
                )
                await until(lambda: served.loop.engine.is_empty(), "the core empty")
                assert state() == dict.fromkeys(state(), 0)
                assert served.control.owned_requests() == 0
        return logs

    logs = run(scenario(), SCENARIO_TIMEOUT_S)
    gone = [e for e in logs if e["event"] == "client gone"]
    forgotten = [e for e in logs if e["event"] == "dropped client forgotten"]
    assert len(gone) == len({e["identity"] for e in gone}) == vanishing
    assert {e["identity"] for e in forgotten} == {e["identity"] for e in gone}
    assert {e["why"] for e in forgotten} == {"silent for 0.2 s"}
    assert all(e["cancelled"] == 1 for e in gone)
