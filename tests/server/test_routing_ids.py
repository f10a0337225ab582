"""No peer can crash the daemon through libzmq's routing ids, nor take another's identity.

The attack (issue 21): libzmq gives an anonymous ROUTER peer `0x00` + a u32 counter that
starts at the C library's unseeded `rand()` (0x006b8b4567 in every process); a peer that
took the counter's next value as its own id first makes libzmq abort the whole daemon when
the next anonymous peer connects. Here both halves are played at full strength, on every
ROUTER the daemon binds: attackers that hold the predicted ids past the ZAP handler (their
READY held back, as libzmq's own sockets never do), then anonymous peers that take libzmq's
counter (their READY held back too), then ordinary clients, all of whom must be served.
"""

from __future__ import annotations

import ctypes
import re
import struct
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq

from engined.wire.kv_events import REPLAY_END_SEQ, seq_bytes
from engined.zmq_sockets import make_socket
from tests.server.daemon_harness import DaemonProcess, start_tcp_daemon
from tests.server.zmtp_peer import ZmtpPeer

# Every ROUTER (and REP, which is one underneath) draws its counter's start from two calls of
# the C library's rand(); unseeded, glibc's sequence is that of srand(1), so the starts of the
# first sockets a process makes are known in advance, whatever their order.
SOCKETS_PREDICTED = 6
IDS_PER_SOCKET = 8
ANONYMOUS = 48


def _pong(reply: dict[str, object]) -> dict[str, object]:
    """`reply` without its `instance_id`, which must be a daemon start's (PROTOCOL §1.5)."""
    rest = dict(reply)
    assert re.fullmatch(r"[0-9a-f]{32}", str(rest.pop("instance_id"))), reply
    return rest


def unseeded_starts(count: int) -> list[int]:
    libc = ctypes.CDLL(None)
    libc.srand(1)
    starts = []
    for _ in range(count):
        low, high = libc.rand(), libc.rand()
        starts.append((low | (high << 31)) % 2**32)
    return starts


PREDICTED = [
    b"\x00" + struct.pack(">I", (start + k) % 2**32)
    for start in unseeded_starts(SOCKETS_PREDICTED)
    for k in range(IDS_PER_SOCKET)
]


def ping(sock: zmq.Socket[bytes], message_id: int) -> dict[str, object]:
    sock.send(msgspec.msgpack.encode({"type": "ping", "id": message_id}))
    assert sock.poll(10_000), "no pong"
    reply: dict[str, object] = msgspec.msgpack.decode(sock.recv())
    return reply


def operator_endpoint(daemon: DaemonProcess) -> str:
    """The welcome's: the private ipc endpoint a tcp control socket also binds."""
    ctx = zmq.Context()
    try:
        client = ctx.socket(zmq.DEALER)
        client.connect(daemon.control)
        client.send(msgspec.msgpack.encode({"type": "hello", "id": 0}))
        assert client.poll(10_000)
        endpoint: str = msgspec.msgpack.decode(client.recv())["operator_endpoint"]
        client.close(linger=0)
        return endpoint
    finally:
        ctx.destroy(linger=0)


def test_a_router_starts_its_anonymous_ids_at_a_seeded_place() -> None:
    """make_socket seeds rand() before every ROUTER, whatever the process did before."""
    ctx = zmq.asyncio.Context()
    ctypes.CDLL(None).srand(1)
    owned = [make_socket(ctx, zmq.ROUTER, "tcp://127.0.0.1:*", bind=True), ctx.socket(zmq.DEALER)]
    try:
        router: zmq.Socket[bytes] = zmq.Socket.shadow(owned[0].underlying)
        dealer: zmq.Socket[bytes] = zmq.Socket.shadow(owned[1].underlying)
        dealer.connect(router.getsockopt_string(zmq.LAST_ENDPOINT))
        dealer.send(b"x")
        assert router.poll(10_000)
        identity, _ = router.recv_multipart()
        assert identity[:1] == b"\x00" and len(identity) == 5
        assert identity != PREDICTED[0]
    finally:
        for sock in owned:
            sock.close(linger=0)
        ctx.term()


@pytest.fixture
def daemon(tmp_path: Path) -> Iterator[DaemonProcess]:
    with start_tcp_daemon(tmp_path, "--speedup-ratio", "0") as process:
        yield process


def _hold_predicted_ids(endpoint: str) -> list[ZmtpPeer]:
    return [ZmtpPeer(endpoint, identity=identity, late_ready=True) for identity in PREDICTED]


@pytest.mark.parametrize("transport", ["tcp", "ipc"])
def test_peers_holding_the_predicted_ids_cannot_crash_the_control_socket(
    tmp_path: Path, daemon: DaemonProcess, transport: str
) -> None:
    endpoint = daemon.control if transport == "tcp" else operator_endpoint(daemon)
    attackers = _hold_predicted_ids(endpoint)
    # Anonymous peers that also hold back their READY take libzmq's own counter.
    anonymous = [ZmtpPeer(endpoint, identity=b"", late_ready=True) for _ in range(ANONYMOUS)]
    ctx = zmq.Context()
    try:
        for k, peer in enumerate(anonymous):
            peer.send(msgspec.msgpack.encode({"type": "ping", "id": k}))
            assert _pong(msgspec.msgpack.decode(peer.recv()[0])) == {"type": "pong", "id": k}
        clients = [ctx.socket(zmq.DEALER) for _ in range(ANONYMOUS)]
        for k, client in enumerate(clients):
            client.connect(endpoint)
            assert _pong(ping(client, k)) == {"type": "pong", "id": k}
        assert daemon.proc.poll() is None
        for k, peer in enumerate(attackers):
            peer.send(msgspec.msgpack.encode({"type": "ping", "id": k}))
            assert _pong(msgspec.msgpack.decode(peer.recv()[0])) == {"type": "pong", "id": k}
        for client in clients:
            client.close(linger=0)
    finally:
        for peer in attackers + anonymous:
            peer.close()
        ctx.destroy(linger=0)


def test_peers_holding_the_predicted_ids_cannot_crash_the_replay_socket(
    daemon: DaemonProcess,
) -> None:
    endpoint = daemon.replay_endpoint()
    attackers = _hold_predicted_ids(endpoint)
    anonymous = [ZmtpPeer(endpoint, identity=b"", late_ready=True) for _ in range(ANONYMOUS)]
    ctx = zmq.Context()
    try:
        for peer in anonymous:
            peer.send(b"", seq_bytes(0))
            assert peer.recv()[-2:] == [REPLAY_END_SEQ, b""]
        client = ctx.socket(zmq.DEALER)
        client.connect(endpoint)
        client.send_multipart([b"", seq_bytes(0)])
        assert client.poll(10_000)
        assert client.recv_multipart()[-2:] == [REPLAY_END_SEQ, b""]
        client.close(linger=0)
        assert daemon.proc.poll() is None
    finally:
        for peer in attackers + anonymous:
            peer.close()
        ctx.destroy(linger=0)


def test_a_departed_clients_routing_id_gets_nothing_of_it(daemon: DaemonProcess) -> None:
    """An anonymous client's id cannot be presented by another: the daemon drew it, or,
    when its READY raced the daemon's reply, libzmq's counter did, from a seeded start.
    Impostors presenting every id an unseeded process would have given get nothing of it."""
    ctx = zmq.Context()
    impostors: list[ZmtpPeer] = []
    try:
        victim = ctx.socket(zmq.DEALER)
        victim.connect(daemon.control)
        submit = {
            "type": "submit",
            "id": 1,
            "request": {"token_ids": list(range(64)), "max_tokens": 2000},
        }
        victim.send(msgspec.msgpack.encode(submit))
        assert victim.poll(10_000)
        assert msgspec.msgpack.decode(victim.recv())["type"] == "submitted"
        victim.close(linger=0)
        impostors = [
            ZmtpPeer(daemon.control, identity=identity, late_ready=True) for identity in PREDICTED
        ]
        witness = ctx.socket(zmq.DEALER)
        witness.connect(daemon.control)
        # wait_idle answers once the victim's request is over: everything sent to it is sent.
        witness.send(msgspec.msgpack.encode({"type": "wait_idle", "id": 2}))
        assert witness.poll(60_000)
        assert msgspec.msgpack.decode(witness.recv())["type"] == "stats"
        for k, impostor in enumerate(impostors):
            impostor.send(msgspec.msgpack.encode({"type": "ping", "id": k}))
            # Its own pong is the first thing it gets: nothing of the victim's came before.
            assert _pong(msgspec.msgpack.decode(impostor.recv()[0])) == {"type": "pong", "id": k}
        witness.close(linger=0)
    finally:
        for impostor in impostors:
            impostor.close()
        ctx.destroy(linger=0)
