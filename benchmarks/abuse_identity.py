"""Issue 21's identity scenarios against a real daemon: libzmq's routing ids and the cap.

Registered in, and run by, benchmarks/abuse.py (same harness, bystanders and figures):

* routing-id-crash: peers hold the routing ids an unseeded process's first six sockets give
  their anonymous peers (READY held back, so the daemon's ZAP reply cannot replace them), then
  anonymous peers connect the same way; did the daemon survive, and what did it answer;
* identity-takeover: a client with its own ROUTING_ID submits a long request and leaves; an
  impostor presenting the same id reads until the request is over; what reached it;
* connection-flood: 1,000 more connections than the cap; how many were refused, how many
  descriptors the daemon holds, and the bystanders' latency meanwhile.

    .venv/bin/python benchmarks/abuse.py routing-id-crash identity-takeover connection-flood
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from abuse_harness import PACED, Figures, Run, scenario  # benchmarks/, beside this
from zmq.utils.monitor import parse_monitor_message

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.server.test_routing_ids import PREDICTED
from tests.server.zmtp_peer import ZmtpPeer

CAP = 1000


def _open_fds(run: Run) -> int:
    assert run.daemon.proc is not None
    with contextlib.suppress(OSError):
        return len(os.listdir(f"/proc/{run.daemon.proc.pid}/fd"))
    return -1


@scenario("routing-id-crash", 21, "peers hold libzmq's predicted routing ids, then anonymous ones")
async def routing_id_crash(run: Run) -> Figures:
    def attack() -> Figures:
        endpoint = run.daemon.control
        held: list[ZmtpPeer] = []
        answered = failed = 0
        try:
            held = [ZmtpPeer(endpoint, identity=rid, late_ready=True) for rid in PREDICTED]
            for k in range(run.scaled(200)):
                try:
                    peer = ZmtpPeer(endpoint, identity=b"", late_ready=True, timeout=5)
                    peer.send(msgspec.msgpack.encode({"type": "ping", "id": k}))
                    answered += msgspec.msgpack.decode(peer.recv()[0])["type"] == "pong"
                    peer.close()
                except OSError:
                    failed += 1
        except OSError:
            failed += 1
        finally:
            for peer in held:
                peer.close()
        assert run.daemon.proc is not None
        return {
            "ids_held": len(held),
            "anonymous_answered": answered,
            "anonymous_failed": failed,
            "daemon_exit": run.daemon.proc.poll(),
        }

    return await asyncio.to_thread(attack)


@scenario("identity-takeover", 21, "an impostor presents a departed client's routing id", *PACED)
async def identity_takeover(run: Run) -> Figures:
    ctx = run.ctx
    victim = ctx.socket(zmq.DEALER)
    victim.setsockopt(zmq.ROUTING_ID, b"victim")
    victim.connect(run.daemon.control)
    submit = {"type": "submit", "id": 1, "request": {"token_ids": [7] * 64, "max_tokens": 300}}
    await victim.send(msgspec.msgpack.encode(submit))
    await victim.recv()
    victim.close(linger=0)
    impostor = ctx.socket(zmq.DEALER)
    impostor.setsockopt(zmq.ROUTING_ID, b"victim")
    impostor.connect(run.daemon.control)
    # The victim's request runs ~3 s (300 passes of 10 ms): read past its end. (wait_idle
    # would wait for the streaming bystander too, which never idles.)
    await impostor.send(msgspec.msgpack.encode({"type": "ping", "id": 2}))
    foreign = 0
    deadline = time.monotonic() + 5
    while (left := deadline - time.monotonic()) > 0:
        if not await impostor.poll(left * 1000):
            break
        reply = msgspec.msgpack.decode(await impostor.recv())
        foreign += reply.get("id") != 2
    impostor.close(linger=0)
    return {"victims_messages_to_impostor": foreign}


@scenario(
    "connection-flood",
    21,
    f"{CAP + 1000:,} connections at once against a cap of {CAP:,}",
    "--max-connections",
    str(CAP),
    *PACED,
)
async def connection_flood(run: Run) -> Figures:
    sockets: list[zmq.asyncio.Socket] = []
    monitors: list[zmq.asyncio.Socket] = []
    # A context of its own: a socket and its monitor each, past libzmq's default 1,023.
    ctx = zmq.asyncio.Context()
    ctx.set(zmq.MAX_SOCKETS, 4 * (CAP + 1000) + 64)
    start = time.monotonic()
    for _ in range(run.scaled(CAP + 1000)):
        sock = ctx.socket(zmq.DEALER)
        sock.linger = 0
        monitors.append(sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH))
        sock.connect(run.daemon.control)
        await sock.send(msgspec.msgpack.encode({"type": "ping"}))
        sockets.append(sock)
    answered = refused = 0
    deadline = time.monotonic() + 30
    pending = set(range(len(sockets)))
    while pending and time.monotonic() < deadline:
        for index in list(pending):
            if await sockets[index].poll(0):
                await sockets[index].recv()
                answered += 1
                pending.discard(index)
            elif await monitors[index].poll(0):
                event = parse_monitor_message(await monitors[index].recv_multipart())
                refused += event["value"] == 500
                pending.discard(index)
        await asyncio.sleep(0.01)
    fds = _open_fds(run)
    for sock in sockets:
        sock.disable_monitor()
        sock.close()
    for monitor in monitors:
        monitor.close()
    ctx.term()
    return {
        "answered": answered,
        "refused_500": refused,
        "no_answer": len(pending),
        "daemon_fds": fds,
        "seconds": round(time.monotonic() - start, 2),
    }
