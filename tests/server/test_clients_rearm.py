"""ClientTable re-arms the control socket's reader once per event-loop turn (clients.py).

A send through the synchronous shadow may consume the ZMQ FD's edge, so EVENTS is read
through the asyncio socket afterwards; this reads it once after a turn's sends rather than
after each. A spy counts the reads. Ordering is asyncio's: a `call_soon` callback made
during a turn runs before the callbacks queued after it, so one `sleep(0)` lets it run.
"""

from __future__ import annotations

import asyncio
from typing import Any

import zmq
import zmq.asyncio

from engined.server.control.clients import ClientTable
from engined.wire import control as wire
from tests.support import run


class EventsSpy:
    """Counts the EVENTS reads made through the asyncio socket's `get`."""

    def __init__(self, sock: zmq.asyncio.Socket) -> None:
        self.reads = 0
        self._get = sock.get

    def __call__(self, option: int) -> Any:
        if option == zmq.EVENTS:
            self.reads += 1
        return self._get(option)


async def scenario() -> tuple[list[int], list[bytes], int]:
    ctx = zmq.asyncio.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("inproc://rearm")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.ROUTING_ID, b"peer")
    dealer.connect("inproc://rearm")
    try:
        await dealer.send(b"hello")
        identity, _ = await router.recv_multipart()
        table = ClientTable(
            router,
            in_flight=lambda _: True,
            dropped=lambda _identity, _episode: None,
            recovered=lambda _identity, _episode: None,
        )
        table.arrived(identity, False)
        spy = EventsSpy(router)
        router.get = spy  # type: ignore[method-assign]
        reads = [spy.reads]
        for n in range(3):
            table.send(identity, wire.Pong(id=n))
        reads.append(spy.reads)  # none yet: the turn is not over
        await asyncio.sleep(0)  # one turn: the re-arm queued during the sends runs first
        reads.append(spy.reads)
        received = [await dealer.recv() for _ in range(3)]
        table.send(identity, wire.Pong(id=3))
        await asyncio.sleep(0)
        received.append(await dealer.recv())
        return reads, received, spy.reads
    finally:
        dealer.close()
        router.close()
        ctx.term()


def test_a_turn_of_sends_reads_events_once() -> None:
    reads, received, total = run(scenario())
    assert reads == [0, 0, 1]
    assert received == [wire.encode_reply(wire.Pong(id=n)) for n in range(4)]
    assert total == 2
