"""`send_frames_nowait` (engined/zmq_sockets.py) sends what `send_multipart(NOBLOCK)` sends.

Plain sockets over inproc, synchronised by messages: the peer sends first, so the ROUTER
knows its identity before anything is sent to it.
"""

from __future__ import annotations

import errno
from collections.abc import Iterator

import pytest
import zmq

from engined.zmq_sockets import send_frames_nowait


class Sockets:
    """A context whose sockets are all closed when the test ends."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.made: list[zmq.Socket[bytes]] = []

    def socket(self, kind: int) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        self.made.append(sock)
        return sock

    def close(self) -> None:
        for sock in self.made:
            sock.close()
        self.ctx.term()


@pytest.fixture
def ctx() -> Iterator[Sockets]:
    sockets = Sockets()
    yield sockets
    sockets.close()


def router_and_dealer(
    ctx: Sockets, name: str, *, hwm: int = 1000
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes], bytes]:
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    router.setsockopt(zmq.SNDHWM, hwm)
    router.bind(f"inproc://{name}")
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVHWM, hwm)
    dealer.setsockopt(zmq.ROUTING_ID, b"peer")
    dealer.connect(f"inproc://{name}")
    dealer.send(b"hello")
    identity, _ = router.recv_multipart()
    return router, dealer, identity


@pytest.mark.parametrize("body", [[b"one"], [b"", b"two", b"x" * 100_000]])
def test_the_frames_arrive_as_one_message(ctx: Sockets, body: list[bytes]) -> None:
    router, dealer, identity = router_and_dealer(ctx, "frames")
    send_frames_nowait(router, [identity, *body])
    send_frames_nowait(router, [identity, b"next"])
    assert dealer.recv_multipart() == body
    assert dealer.recv_multipart() == [b"next"]


def test_an_unknown_peer_is_refused_as_send_multipart_refuses_it(
    ctx: Sockets,
) -> None:
    router, _, _ = router_and_dealer(ctx, "unknown")
    with pytest.raises(zmq.ZMQError) as raised:
        send_frames_nowait(router, [b"nobody", b"body"])
    assert raised.value.errno == errno.EHOSTUNREACH
    with pytest.raises(zmq.ZMQError) as expected:
        router.send_multipart([b"nobody", b"body"], flags=zmq.NOBLOCK)
    assert expected.value.errno == errno.EHOSTUNREACH


def test_a_full_pipe_refuses_the_whole_message(ctx: Sockets) -> None:
    router, dealer, identity = router_and_dealer(ctx, "full", hwm=1)
    sent = 0
    with pytest.raises(zmq.ZMQError) as raised:
        for _ in range(100):
            send_frames_nowait(router, [identity, b"a", b"b"])
            sent += 1
    assert raised.value.errno == zmq.EAGAIN
    assert sent >= 1
    received = []
    while dealer.poll(0):
        received.append(dealer.recv_multipart())
    # Every message that went out went out whole; the refused one left nothing behind.
    assert received == [[b"a", b"b"]] * sent
