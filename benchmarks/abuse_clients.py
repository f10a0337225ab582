"""Issue 10's client-side abuse scenarios (defects 5, 6, 8, 9, 10) against a real daemon.

Registered in, and run by, benchmarks/abuse.py, on the same harness (benchmarks/abuse_harness.py): a
fresh daemon per scenario, two bystanders (a streaming client and a pinging one) and the
systemd watchdog timed while the scenario plays, and the scenario's own figures:

* foreign-cancel (5): a router cancels 200 requests it does not own; how many owners' streams
  ended, with how many terminals each, and how long after the cancel was sent;
* slow-reader (6): a client submits 100 requests, sends 150,000 pings without reading, then
  1,000 more, then reads everything; what it was told, and the daemon's log lines about it;
* bad-key (8): a 16 MiB unknown key; the size of the reply and of the daemon's log line;
* bad-utf8-id (9): 1,000 messages with invalid UTF-8 beside their id; how many got it back;
* short-lived-clients (10): three times 20,000 clients that ping and go, then 2,000 that
  vanish with a request running; the daemon's RSS growth per round, and whether the vanished
  requests were freed.

    .venv/bin/python benchmarks/abuse.py [SCENARIO ...] [--scale 0.1] [--engined-root DIR]

`--engined-root` runs the daemon from another checkout (the code before the fix), to compare
in one sitting; figures vary with the machine's load.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from abuse_harness import PACED, Figures, Run, scenario  # benchmarks/, beside this

from engined.client import EngineClient
from engined.wire.control import DirectReply, ErrorReply, Output, Pong, ReplyDecoder

DECODER = ReplyDecoder()


def encode(**fields: Any) -> bytes:
    return msgspec.msgpack.encode(fields)


def fixstr(raw: bytes) -> bytes:
    return bytes([0xA0 | len(raw)]) + raw


def log_records(run: Run) -> list[dict[str, Any]]:
    records = []
    for line in (run.daemon.root / "engined.log").read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


def log_lines(run: Run, event: str) -> list[str]:
    path = run.daemon.root / "engined.log"
    return [line for line in path.read_text(errors="replace").splitlines() if f'"{event}"' in line]


# --- 5: another client's cancel -----------------------------------------------------------------


@scenario("foreign-cancel", 5, "a router cancels 200 running requests it does not own", *PACED)
async def foreign_cancel(run: Run) -> Figures:
    count = run.scaled(200)
    ended = terminals = 0
    latencies: list[float] = []
    async with (
        await EngineClient.connect(run.daemon.control, ctx=run.ctx) as owner,
        await EngineClient.connect(run.daemon.control, ctx=run.ctx) as router,
    ):
        for n in range(count):
            request_id = f"owned-{n}"
            await owner.submit([n % 1000 + 1] * 64, 10_000, request_id=request_id)
            stream = owner.outputs(request_id, timeout=5)
            await anext(stream)  # running
            sent = time.monotonic()
            await router.cancel(request_id)
            try:
                async for entry in stream:
                    terminals += entry.finished
                ended += 1
                latencies.append(time.monotonic() - sent)
            except TimeoutError:
                pass  # the owner's stream hung
    latencies.sort()
    return {
        "cancelled": count,
        "owner_streams_ended": ended,
        "terminals": terminals,
        "end_after_cancel_p50_ms": round(1000 * statistics.median(latencies), 2)
        if latencies
        else "none",
        "end_after_cancel_max_ms": round(1000 * latencies[-1], 2) if latencies else "none",
    }


# --- 6: a client that stops reading -------------------------------------------------------------


def _slow_client(
    endpoint: str, requests: int, flood: int, later: int, dropped: Callable[[], bool]
) -> Figures:
    """Submit, flood without reading until dropped, send more, then read everything (a
    thread)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.connect(endpoint)
    ids = itertools.count(1)
    try:
        for n in range(requests):
            request = {"request_id": f"slow-{n}", "token_ids": [n + 1] * 64, "max_tokens": 100_000}
            sock.send(encode(type="submit", request=request, id=next(ids)))
        ping = [encode(type="ping", id=next(ids)) for _ in range(flood)]
        for body in ping:
            sock.send(body)
        # Not reading until the daemon has given up on it (its log says so).
        flooded = time.monotonic()
        while not dropped() and time.monotonic() < flooded + 120:
            time.sleep(0.1)
        dropped_after = time.monotonic() - flooded
        start_later = time.monotonic()
        for _ in range(later):
            sock.send(encode(type="ping", id=next(ids)))
        sent = next(ids) - 1
        read_start = time.monotonic()
        replies: dict[int | str, str] = {}
        summarised = 0
        cancelled: dict[str, int] = {}
        other_terminals = 0
        # Read until the daemon has nothing more to say for 3 s (a run by hand, not a test).
        sock.setsockopt(zmq.RCVTIMEO, 3000)
        with contextlib.suppress(zmq.Again):
            while True:
                msg = DECODER.decode(sock.recv())
                if isinstance(msg, Output):
                    for entry in msg.outputs:
                        if entry.finished and entry.finish_reason == "cancelled":
                            cancelled[entry.request_id] = cancelled.get(entry.request_id, 0) + 1
                        elif entry.finished:
                            other_terminals += 1
                elif isinstance(msg, ErrorReply) and msg.id is None:
                    # "N more messages were not processed: ..."
                    summarised += int(msg.message.split(" ", 1)[0])
                elif isinstance(msg, DirectReply) and msg.id is not None:
                    kind = type(msg).__name__
                    if isinstance(msg, ErrorReply):
                        kind = f"error:{msg.code}"
                    replies[msg.id] = kind
        # And a last message, now that it has read everything.
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        sock.send(encode(type="ping", id="after"))
        last = "none"
        with contextlib.suppress(zmq.Again):
            while True:
                msg = DECODER.decode(sock.recv())
                if isinstance(msg, DirectReply) and msg.id == "after":
                    last = "pong" if isinstance(msg, Pong) else type(msg).__name__
                    break
        kinds: dict[str, int] = {}
        for kind in replies.values():
            kinds[kind] = kinds.get(kind, 0) + 1
        return {
            "messages_sent": sent,
            "replies": kinds,
            "counted_in_one_error": summarised,
            "unaccounted": sent - len(replies) - summarised,
            "requests_told_cancelled": len(cancelled),
            "terminals_per_request": sorted(set(cancelled.values())),
            "other_terminals": other_terminals,
            "dropped_after_flood_s": round(dropped_after, 1),
            "later_sends_s": round(read_start - start_later, 2),
            "reply_after_reading": last,
        }
    finally:
        sock.close()
        ctx.term()


@scenario(
    "slow-reader",
    6,
    "100 requests, 150,000 pings unread, 1,000 more, then read",
    *PACED,
    "--num-gpu-blocks",
    "65536",
)
async def slow_reader(run: Run) -> Figures:
    figures = await asyncio.to_thread(
        _slow_client,
        run.daemon.control,
        run.scaled(100),
        run.scaled(150_000),
        run.scaled(1000),
        lambda: bool(log_lines(run, "client gone")),
    )
    gone = log_lines(run, "client gone")
    back = log_lines(run, "client back")
    return {**figures, "log_client_gone": len(gone), "log_client_back": len(back)}


# --- 8 and 9: what errors echo ------------------------------------------------------------------


@scenario("bad-key", 8, "one message with a 16 MiB unknown key", "--speedup-ratio", "0")
async def bad_key(run: Run) -> Figures:
    body = encode(type="ping", id=1, **{"k" * (16 << 20): 1})
    sock = run.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(run.daemon.control)
    start = time.monotonic()
    await sock.send(body)
    reply = await asyncio.wait_for(sock.recv(), 60)
    answered = time.monotonic() - start
    sock.close()
    lines = log_lines(run, "bad message")
    decoded = DECODER.decode(reply)
    return {
        "message_bytes": len(body),
        "reply_bytes": len(reply),
        "reply_id": getattr(decoded, "id", None),
        "log_line_bytes": max((len(line) for line in lines), default=0),
        "answered_ms": round(1000 * answered, 1),
    }


@scenario(
    "bad-utf8-id", 9, "1,000 messages with invalid UTF-8 beside their id", "--speedup-ratio", "0"
)
async def bad_utf8_id(run: Run) -> Figures:
    count = run.scaled(1000)
    sock = run.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(run.daemon.control)
    pack = msgspec.msgpack.encode
    shapes = [
        # invalid UTF-8 in `type`; in a key; a message cut short after its id
        lambda n: b"\x82" + fixstr(b"type") + fixstr(b"pi\xff") + fixstr(b"id") + pack(n),
        lambda n: b"\x82" + fixstr(b"\xc3\x28") + b"\x01" + fixstr(b"id") + pack(n),
        lambda n: b"\x83" + fixstr(b"id") + pack(n) + fixstr(b"type") + fixstr(b"submit") + b"\x81",
    ]
    echoed = 0
    for n in range(count):
        await sock.send(shapes[n % len(shapes)](n))
        reply = DECODER.decode(await asyncio.wait_for(sock.recv(), 10))
        echoed += isinstance(reply, ErrorReply) and reply.id == n
    sock.close()
    return {"messages": count, "id_echoed": echoed}


# --- 10: per-client state -----------------------------------------------------------------------


def _short_lived(endpoint: str, count: int, vanish: bool, offset: int) -> int:
    """`count` clients, one after another: ping and go, or submit a long request and vanish."""
    ctx = zmq.Context()
    done = 0
    try:
        for n in range(count):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVTIMEO, 10_000)
            sock.connect(endpoint)
            if vanish:
                request = {"token_ids": [(offset + n) % 5000 + 1] * 16, "max_tokens": 100_000}
                sock.send(encode(type="submit", request=request, id=1))
            else:
                sock.send(encode(type="ping", id=1))
            with contextlib.suppress(zmq.Again):
                sock.recv()
                done += 1
            sock.close()
    finally:
        ctx.term()
    return done


@scenario(
    "short-lived-clients",
    10,
    "3 x 20,000 clients that ping and go, 2,000 that vanish mid-request",
    "--speedup-ratio",
    "0",
    "--num-gpu-blocks",
    "65536",
)
async def short_lived_clients(run: Run) -> Figures:
    before = run.daemon.rss_mb()
    threads = 4
    # Three rounds: what the first costs includes the allocator's and libzmq's one-off growth;
    # per-client state that is never freed shows as the same growth again in the others.
    rounds = []
    counts = []
    for _ in range(3):
        start = run.daemon.rss_mb()
        counts += await asyncio.gather(
            *(
                asyncio.to_thread(_short_lived, run.daemon.control, run.scaled(5000), False, t)
                for t in range(threads)
            )
        )
        rounds.append(round(run.daemon.rss_mb() - start, 1))
    after_pings = run.daemon.rss_mb()
    vanished = await asyncio.gather(
        *(
            asyncio.to_thread(_short_lived, run.daemon.control, run.scaled(500), True, 1000 * t)
            for t in range(threads)
        )
    )
    async with await EngineClient.connect(run.daemon.control, ctx=run.ctx) as client:
        deadline = time.monotonic() + 60
        running = -1
        while time.monotonic() < deadline:
            rank = (await client.stats()).ranks[0]
            # The bystander's own request is the one left running.
            running = rank.running + rank.waiting
            if running <= 1:
                break
            await asyncio.sleep(0.1)
    after_vanished = run.daemon.rss_mb()
    gone = [r for r in log_records(run) if r.get("event") == "client gone"]
    return {
        "pinged_and_went": sum(counts),
        "rss_growth_per_20000_mb": rounds,
        "rss_after_pings_mb": round(after_pings - before, 1),
        "vanished_mid_request": sum(vanished),
        "left_running": running,
        "log_client_gone": len(gone),
        "rss_after_vanished_mb": round(after_vanished - before, 1),
    }
