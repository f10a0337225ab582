"""Issue 21's abuse scenarios ("Budgets in bytes") against a real daemon.

Registered in, and run by, benchmarks/abuse.py, on the same harness (benchmarks/abuse_harness.py):
a fresh daemon per scenario, two bystanders (a streaming client and a pinging one) and the
systemd watchdog timed while the scenario plays, and the scenario's own figures. Memory is
the daemon's RSS: `rss_peak_mb` from its high-water mark (VmHWM), `rss_kept_mb` after the
scenario, both against the RSS before it.

* huge-submit: one 60 MB `submit` (60M one-byte token ids);
* pipelined-submits: 20 of them from one client, sent without waiting;
* inflight-submits: 20 requests of 100,000 prompt tokens and 1M planned output ids each (6 MB
  messages, under every message limit), pipelined from one client, held in flight;
* huge-vocabulary: one `set_vocabulary` with 60M excluded ids (60 MB), then 20 `hello`s not
  read, and the size of a later `welcome`;
* hello-flood: the largest vocabulary allowed (8,192 excluded ids), then 20,000 `hello`s
  never read;
* wait-idle-hog: 1,024 `wait_idle`s from one client while a request runs, then one from a
  bystander.

    .venv/bin/python benchmarks/abuse.py huge-submit [...] [--engined-root DIR]
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio
from abuse_harness import PACED, Figures, Run, scenario  # benchmarks/, beside this

from engined.client import EngineClient, EngineError
from engined.wire.control import ErrorReply, ReplyDecoder, Welcome

DECODER = ReplyDecoder()
HUGE_TOKENS = 60_000_000
ISSUE = 21


def peak_mb(run: Run) -> float:
    """The daemon's resident high-water mark against its RSS before the scenario."""
    assert run.daemon.proc is not None
    status = Path(f"/proc/{run.daemon.proc.pid}/status").read_text()
    for line in status.splitlines():
        if line.startswith("VmHWM:"):
            return round(int(line.split()[1]) / 1024 - run.rss_before, 1)
    return float("nan")


def _send_and_count(endpoint: str, bodies: list[bytes], quiet_s: float) -> Figures:
    """Send `bodies` from one DEALER without waiting, then read replies until `quiet_s`
    passes without one (a thread: the sends block while libzmq takes 60 MB frames)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    try:
        start = time.monotonic()
        for body in bodies:
            sock.send(body, copy=False)
        sock.setsockopt(zmq.RCVTIMEO, int(quiet_s * 1000))
        codes: dict[str, int] = {}
        with contextlib.suppress(zmq.Again):
            while sum(codes.values()) < len(bodies):
                reply = DECODER.decode(sock.recv())
                kind = (
                    f"error:{reply.code}" if isinstance(reply, ErrorReply) else type(reply).__name__
                )
                codes[kind] = codes.get(kind, 0) + 1
        return {
            "replies": codes or "none (the connection was cut)",
            "answered_s": round(time.monotonic() - start, 1),
        }
    finally:
        sock.close()
        ctx.term()


def _huge_submit() -> bytes:
    request = {"token_ids": [1] * HUGE_TOKENS, "max_tokens": 1}
    return msgspec.msgpack.encode({"type": "submit", "request": request})


@scenario("huge-submit", ISSUE, "one 60 MB submit (60M one-byte token ids)", *PACED)
async def huge_submit(run: Run) -> Figures:
    body = _huge_submit()
    figures = await asyncio.to_thread(_send_and_count, run.daemon.control, [body], 10.0)
    return {"message_mb": round(len(body) / 1e6), **figures, "rss_peak_mb": peak_mb(run)}


@scenario("pipelined-submits", ISSUE, "20 pipelined 60 MB submits from one client", *PACED)
async def pipelined_submits(run: Run) -> Figures:
    body = _huge_submit()
    figures = await asyncio.to_thread(_send_and_count, run.daemon.control, [body] * 20, 10.0)
    return {**figures, "rss_peak_mb": peak_mb(run), "rss_kept_mb": run.rss_growth()}


@scenario(
    "inflight-submits",
    ISSUE,
    "20 pipelined requests of 100,000 prompt tokens and 1M planned ids each, held in flight",
    *PACED,
)
async def inflight_submits(run: Run) -> Figures:
    bodies = []
    for n in range(20):
        request = {
            "token_ids": [n * 100_000 + t for t in range(100_000)],
            "max_tokens": 1,
            "output_token_ids": [2**32 - 1] * 1_000_000,
        }
        bodies.append(msgspec.msgpack.encode({"type": "submit", "request": request}))
    figures = await asyncio.to_thread(_send_and_count, run.daemon.control, bodies, 10.0)
    return {
        "message_mb": round(len(bodies[0]) / 1e6, 1),
        **figures,
        "rss_peak_mb": peak_mb(run),
        "rss_kept_mb": run.rss_growth(),
    }


async def _welcome_bytes(run: Run) -> int:
    sock = run.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(run.daemon.control)
    try:
        await sock.send(msgspec.msgpack.encode({"type": "hello"}))
        reply = await asyncio.wait_for(sock.recv(), 60)
        assert isinstance(DECODER.decode(reply), Welcome)
        return len(reply)
    finally:
        sock.close()


async def _unread_hellos(run: Run, count: int) -> zmq.asyncio.Socket:
    sock = run.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 1)
    sock.connect(run.daemon.control)
    hello = msgspec.msgpack.encode({"type": "hello"})
    for _ in range(count):
        await sock.send(hello)
    return sock


@scenario(
    "huge-vocabulary",
    ISSUE,
    "set_vocabulary with 60M excluded ids, then 20 hellos never read",
    "--speedup-ratio",
    "0",
)
async def huge_vocabulary(run: Run) -> Figures:
    body = msgspec.msgpack.encode(
        {"type": "set_vocabulary", "vocab_size": None, "excluded_token_ids": [7] * HUGE_TOKENS}
    )
    figures = await asyncio.to_thread(_send_and_count, run.daemon.control, [body], 20.0)
    peak = peak_mb(run)
    sock = await _unread_hellos(run, 20)
    async with await EngineClient.connect(run.daemon.control, ctx=run.ctx) as client:
        for _ in range(20):
            await client.ping(timeout=120)  # the daemon has read the hellos by now
    welcome = await _welcome_bytes(run)
    kept = run.rss_growth()
    sock.close()
    return {
        "set_vocabulary": figures["replies"],
        "answered_s": figures["answered_s"],
        "rss_peak_mb": peak,
        "welcome_bytes_after": welcome,
        "rss_kept_after_20_unread_hellos_mb": kept,
    }


def _log_count(run: Run, event: str) -> int:
    return (run.daemon.root / "engined.log").read_text().count(f'"{event}"')


async def _settled(run: Run) -> float:
    """Seconds until the daemon dropped the client, or its RSS stayed put for 3 s (a run by
    hand, not a test: the flooder cannot read a reply that would say it is done)."""
    start = time.monotonic()
    last, steady_since = run.daemon.rss_mb(), time.monotonic()
    while time.monotonic() < start + 300 and not _log_count(run, "client gone"):
        await asyncio.sleep(0.25)
        now = run.daemon.rss_mb()
        if abs(now - last) > 1.0:
            last, steady_since = now, time.monotonic()
        elif time.monotonic() - steady_since > 3.0:
            return round(steady_since - start, 1)
    return round(time.monotonic() - start, 1)


@scenario(
    "hello-flood",
    ISSUE,
    "8,192 excluded ids (the most allowed), then 20,000 hellos never read",
    "--speedup-ratio",
    "0",
)
async def hello_flood(run: Run) -> Figures:
    ids = list(range(2**32 - 8192, 2**32))
    async with await EngineClient.connect(run.daemon.control, ctx=run.ctx) as client:
        await client.set_vocabulary(2**32, ids, timeout=60)
        welcome = await _welcome_bytes(run)
        sock = await _unread_hellos(run, run.scaled(20_000))
        took = await _settled(run)
    grown = run.rss_growth()
    gone = _log_count(run, "client gone")
    sock.close()
    return {
        "welcome_bytes": welcome,
        "settled_s": took,
        "rss_kept_mb": grown,
        "rss_peak_mb": peak_mb(run),
        "log_client_gone": gone,
    }


@scenario("wait-idle-hog", ISSUE, "1,024 wait_idles from one client, then a bystander's", *PACED)
async def wait_idle_hog(run: Run) -> Figures:
    async with (
        await EngineClient.connect(run.daemon.control, ctx=run.ctx) as hog,
        await EngineClient.connect(run.daemon.control, ctx=run.ctx) as other,
    ):
        await hog.submit(list(range(64)), 100_000, timeout=30)
        waits = [asyncio.ensure_future(hog.wait_idle(timeout=None)) for _ in range(1024)]
        # The first ping's round trip lets the waits' tasks send them; the second follows
        # them, so every refusal has arrived before its pong.
        await hog.ping(timeout=30)
        await hog.ping(timeout=30)
        refused = sum(1 for w in waits if w.done() and isinstance(w.exception(), EngineError))
        mine = asyncio.ensure_future(other.wait_idle(timeout=None))
        await other.ping(timeout=30)
        await other.ping(timeout=30)
        if mine.done():
            error = mine.exception()
            outcome = f"error:{error.code}" if isinstance(error, EngineError) else "answered"
        else:
            outcome = "waiting (admitted)"
        for wait in [*waits, mine]:
            wait.cancel()
        await asyncio.gather(*waits, mine, return_exceptions=True)
    return {"hog_waits_refused": refused, "bystander_wait_idle": outcome}
