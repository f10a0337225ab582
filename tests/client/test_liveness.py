"""`engined.client` notices a lost daemon within its liveness bound, and a restarted one.

Real `engined serve` processes: one killed with SIGKILL (its connection drops at once), one
stopped with SIGSTOP (it stops answering ZMTP heartbeats), one restarted on the same
endpoints (a new `instance_id`). Every wait is a deadline on an event, never a sleep.
"""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import pytest
import zmq

from engined.client import (
    ConnectionBack,
    ConnectionLost,
    DaemonLost,
    EngineClient,
)
from tests.server.daemon_harness import PACED_FLAGS, DaemonProcess

# Paced, so a long request is still streaming when the daemon dies.
PACED = [*PACED_FLAGS, "--block-size", "16"]
LIVENESS_S = 2.0
# Generous: a restarted daemon's first handshake waits for its Python start-up.
RESTART_TIMEOUT_S = 60.0


def _daemon(tmp_path: Path, control: str | None = None) -> DaemonProcess:
    daemon = DaemonProcess(tmp_path, list(PACED), None, control)
    daemon.wait_ready()
    return daemon


def test_killed_daemon_ends_calls_and_streams_then_its_restart_is_reported(
    tmp_path: Path,
) -> None:
    first = _daemon(tmp_path)

    async def scenario() -> None:
        async with await EngineClient.connect(first.control, liveness_s=LIVENESS_S) as client:
            welcome = await client.hello()
            assert welcome.instance_id is not None and len(welcome.instance_id) == 32
            assert client.instance_id == welcome.instance_id
            assert (await client.ping()).instance_id == welcome.instance_id
            submitted = await client.submit([1, 2, 3, 4], 100_000, request_id="long")
            stream = client.outputs(submitted.request_id, timeout=None)
            first_entry = await anext(stream)
            assert first_entry.request_id == "long"
            idle = asyncio.ensure_future(client.wait_idle(timeout=None))

            first.proc.kill()
            assert first.proc.wait(30) == -signal.SIGKILL
            lost = await client.next_connection_event(timeout=LIVENESS_S)
            assert isinstance(lost, ConnectionLost)
            with pytest.raises(DaemonLost):
                await idle
            with pytest.raises(DaemonLost):
                async for _entry in stream:
                    pass
            assert client.daemon_lost
            with pytest.raises(DaemonLost):
                await client.ping(timeout=None)

            second = await asyncio.to_thread(_daemon, tmp_path, first.control)
            try:
                back = await client.next_connection_event(timeout=RESTART_TIMEOUT_S)
                assert isinstance(back, ConnectionBack)
                assert back.restarted is True
                assert back.welcome.instance_id not in (None, welcome.instance_id)
                assert client.instance_id == back.welcome.instance_id
                assert not client.daemon_lost
                assert (await client.ping()).instance_id == back.welcome.instance_id
                generation = await client.generate([5, 6, 7], 3)
                assert len(generation.token_ids) == 3
            finally:
                await asyncio.to_thread(second.stop)

    try:
        asyncio.run(scenario())
    finally:
        first.stop()


def test_what_a_draining_daemon_sent_before_it_exited_comes_before_the_loss(
    tmp_path: Path,
) -> None:
    """A daemon drains at SIGTERM: it sends a request's last outputs, then exits and its
    connection ends. Both can wait on the client side at once (the client's loop was busy):
    every output is read, the request finishes, and only then is the daemon lost."""
    daemon = _daemon(tmp_path)
    tokens = 40

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control, liveness_s=LIVENESS_S) as client:
            await client.submit(list(range(1, 33)), tokens, request_id="last-words")
            # The loop is held from here until the end of the connection is queued behind
            # every output, as a busy client would be.
            daemon.proc.send_signal(signal.SIGTERM)
            assert daemon.proc.wait(30) == 0, daemon.log()
            monitor = client._liveness._monitor
            deadline = time.monotonic() + LIVENESS_S
            while not int(monitor.get(zmq.EVENTS)) & zmq.POLLIN:
                assert time.monotonic() < deadline, "libzmq never reported the disconnection"
            received: list[int] = []
            finish = None
            async for entry in client.outputs("last-words", timeout=LIVENESS_S):
                received += entry.token_ids
                finish = entry.finish_reason
            assert (len(received), finish) == (tokens, "length")
            lost = await client.next_connection_event(timeout=LIVENESS_S)
            assert isinstance(lost, ConnectionLost)

    asyncio.run(scenario())
    assert daemon.stop() == 0, daemon.log()


def test_stopped_daemon_is_lost_within_the_bound_and_back_as_the_same_start(
    tmp_path: Path,
) -> None:
    daemon = _daemon(tmp_path)

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control, liveness_s=LIVENESS_S) as client:
            welcome = await client.hello()
            daemon.proc.send_signal(signal.SIGSTOP)
            try:
                pending = asyncio.ensure_future(client.ping(timeout=None))
                lost = await client.next_connection_event(timeout=LIVENESS_S)
                assert isinstance(lost, ConnectionLost)
                with pytest.raises(DaemonLost):
                    await pending
            finally:
                daemon.proc.send_signal(signal.SIGCONT)
            back = await client.next_connection_event(timeout=RESTART_TIMEOUT_S)
            assert isinstance(back, ConnectionBack)
            assert back.restarted is False
            assert back.welcome.instance_id == welcome.instance_id

    try:
        asyncio.run(scenario())
    finally:
        assert daemon.stop() == 0, daemon.log()


def test_without_a_bound_no_heartbeat_and_no_loss_is_reported(tmp_path: Path) -> None:
    daemon = _daemon(tmp_path)

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control, liveness_s=None) as client:
            await client.hello()
            daemon.proc.kill()
            daemon.proc.wait(30)
            with pytest.raises(TimeoutError):
                await client.next_connection_event(timeout=LIVENESS_S)
            assert not client.daemon_lost

    try:
        asyncio.run(scenario())
    finally:
        daemon.stop()


@pytest.mark.parametrize("bound", [0.0, 0.05, float("nan")])
def test_a_bound_below_a_tenth_of_a_second_is_refused(bound: float) -> None:
    async def scenario() -> None:
        with pytest.raises(ValueError, match=r"liveness_s: expected at least 0\.1 s"):
            await EngineClient.connect("ipc:///nonexistent/engined", liveness_s=bound)

    asyncio.run(scenario())


def test_requests_that_finished_before_the_loss_are_still_collected_after_it(
    tmp_path: Path,
) -> None:
    """Two requests finish while a daemon drains at SIGTERM and exits; nobody reads them
    until the client has reported the loss. Their outputs came before the loss, so both
    are collected whole afterwards, as `collect` after a drain expects (a lost connection's
    unfinished requests are gone with it, its finished ones are not)."""
    daemon = _daemon(tmp_path)

    async def scenario() -> None:
        async with await EngineClient.connect(daemon.control, liveness_s=LIVENESS_S) as client:
            first = await client.submit(list(range(1, 33)), 8, request_id="short")
            second = await client.submit(list(range(1, 33)), 40, request_id="longer")
            daemon.proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(daemon.proc.wait, 30) == 0, daemon.log()
            lost = await client.next_connection_event(timeout=LIVENESS_S)
            assert isinstance(lost, ConnectionLost)
            short = await client.collect(first, timeout=LIVENESS_S)
            longer = await client.collect(second, timeout=LIVENESS_S)
            assert (len(short.token_ids), short.finish_reason) == (8, "length")
            assert (len(longer.token_ids), longer.finish_reason) == (40, "length")
            with pytest.raises(DaemonLost):
                async for _ in client.outputs("never-submitted", timeout=LIVENESS_S):
                    pass

    asyncio.run(scenario())
    assert daemon.stop() == 0, daemon.log()
