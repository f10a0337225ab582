"""Issue 21's abuse scenarios (defects 1, 3 and 4) against a real daemon.

Registered in, and run by, benchmarks/abuse.py, on its harness (benchmarks/abuse_harness.py):

* ipc-lock-symlink (1): another local user plants the control socket's `<path>.lock` as a
  symlink to a file that does not exist; a daemon started on that path: its exit code, and
  whether the symlink's target was created;
* sigterm-flood (3): a raw DEALER sends 5,000 submits as fast as it can and SIGTERM arrives
  once 100 replies are in; how many submits got a reply, and whether every `submitted` got
  exactly one terminal after it;
* vanishing-rounds (4): 15 rounds of 1,000 clients that connect at once, submit, leave
  their outputs unread for half a second and disappear; the daemon's RSS after each round,
  idle once every dropped client has been forgotten (or after 90 s), and 35 s later (an
  idle daemon trims its heap within 30 s, engined/server/ops/heap.py).

    .venv/bin/python benchmarks/abuse.py sigterm-flood [--engined-root DIR]
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import msgspec
import zmq
from abuse_harness import Figures, Run, scenario  # benchmarks/, beside this

from engined.client import EngineClient

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from engined.wire.control import ErrorReply, Output, ReplyDecoder, Submitted
from tests.server.test_shutdown_flood import flood_through_sigterm

DECODER = ReplyDecoder()


def _submit(message_id: int, max_tokens: int, seed: int) -> bytes:
    request = {"token_ids": [seed % 5000 + 1] * 16, "max_tokens": max_tokens}
    return msgspec.msgpack.encode({"type": "submit", "id": message_id, "request": request})


def _log_events(run: Run, event: str) -> int:
    count = 0
    for line in (run.daemon.root / "engined.log").read_text(errors="replace").splitlines():
        try:
            count += json.loads(line).get("event") == event
        except ValueError:
            continue
    return count


# --- 1: a planted lock file ----------------------------------------------------------------------


@scenario("ipc-lock-symlink", 21, "a daemon on an ipc path whose .lock is a planted symlink")
async def ipc_lock_symlink(run: Run) -> Figures:
    with tempfile.TemporaryDirectory(prefix="engined-lock-") as tmp:
        target = Path(tmp) / "elsewhere"
        Path(f"{tmp}/control.lock").symlink_to(target)
        cmd = [sys.executable, "-m", "engined.cli", "serve", "--control-endpoint"]
        cmd += [f"ipc://{tmp}/control", "--kv-events-endpoint", f"ipc://{tmp}/kv"]
        cmd += ["--fpm-endpoint", ""]
        daemon = subprocess.Popen(cmd, cwd=run.daemon.engined_root, stderr=subprocess.DEVNULL)
        try:
            code: int | str = await asyncio.to_thread(daemon.wait, 10)
        except subprocess.TimeoutExpired:
            code = "still running"
            daemon.terminate()
            daemon.wait(30)
        return {"exit_code": code, "symlink_target_created": target.exists()}


# --- 3: SIGTERM during a flood -------------------------------------------------------------------


@scenario(
    "sigterm-flood",
    21,
    "5,000 submits on a raw DEALER, SIGTERM once 100 are answered",
    "--speedup-ratio",
    "0",
    "--drain-timeout",
    "0",
    "--max-queued-requests",
    "0",
)
async def sigterm_flood(run: Run) -> Figures:
    count = run.scaled(5000)
    stop = threading.Event()
    flood = asyncio.create_task(
        asyncio.to_thread(flood_through_sigterm, run.daemon.control, stop.set, count)
    )
    await asyncio.to_thread(stop.wait, 60)
    assert run.daemon.proc is not None
    run.daemon.proc.send_signal(signal.SIGTERM)
    exit_s = await asyncio.to_thread(run.daemon.stop, signal.SIGTERM, 60)
    received = await flood
    answered: dict[object, str] = {}
    submitted_at: dict[str, int] = {}
    first_terminal: dict[str, int] = {}
    for position, message in enumerate(received):
        if isinstance(message, Output):
            for entry in message.outputs:
                if entry.finished:
                    first_terminal.setdefault(entry.request_id, position)
        elif isinstance(message, Submitted):
            answered[message.id] = "submitted"
            submitted_at[message.request_id] = position
        elif isinstance(message, ErrorReply):
            answered[message.id] = message.code
    kinds: dict[str, int] = {}
    for kind in answered.values():
        kinds[kind] = kinds.get(kind, 0) + 1
    late = [r for r, at in submitted_at.items() if first_terminal.get(r, at + 1) < at]
    return {
        "submits": count,
        "answered": len(answered),
        "unanswered": count - len(answered),
        "replies": kinds,
        "submitted_without_terminal": sum(r not in first_terminal for r in submitted_at),
        "terminal_before_submitted": len(late),
        "exit_code": run.daemon.proc.returncode,
        "sigterm_exit_s": round(exit_s, 2),
    }


# --- 4: clients that vanish without reading ------------------------------------------------------


def _vanish(endpoint: str, count: int, offset: int) -> None:
    """`count` clients at once: connect, submit a long request, leave its outputs unread for
    half a second, close."""
    ctx = zmq.Context()
    socks = []
    try:
        for n in range(count):
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 1000)  # the submit leaves before the socket goes
            sock.connect(endpoint)
            sock.send(_submit(1, 100_000, offset + n))
            socks.append(sock)
        time.sleep(0.5)
    finally:
        for sock in socks:
            sock.close()
        ctx.term()


@scenario(
    "vanishing-rounds",
    21,
    "15 rounds of 1,000 clients that submit and vanish without reading",
    "--speedup-ratio",
    "0",
    "--num-gpu-blocks",
    "65536",
)
async def vanishing_rounds(run: Run) -> Figures:
    threads = 4
    start = run.daemon.rss_mb()
    after_round = []
    async with await EngineClient.connect(run.daemon.control, ctx=run.ctx) as client:
        for r in range(15):
            per_thread = run.scaled(1000) // threads
            await asyncio.gather(
                *(
                    asyncio.to_thread(_vanish, run.daemon.control, per_thread, r * 1000 + 250 * t)
                    for t in range(threads)
                )
            )
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                rank = (await client.stats()).ranks[0]
                if rank.running + rank.waiting <= 1:  # the bystander's own request
                    break
                await asyncio.sleep(0.1)
            after_round.append(round(run.daemon.rss_mb() - start, 1))
        loaded = time.monotonic()
        gone = _log_events(run, "client gone")
        forgotten = "dropped client forgotten"
        while time.monotonic() < loaded + 90 and _log_events(run, forgotten) < gone:
            await client.ping()
            await asyncio.sleep(1)
        idle_s = round(time.monotonic() - loaded)
        rss_idle = round(run.daemon.rss_mb() - start, 1)
        await asyncio.sleep(35)
    return {
        "rss_growth_per_round_mb": after_round,
        "client_gone": gone,
        "forgotten": _log_events(run, forgotten),
        "idle_s": idle_s,
        "rss_idle_mb": rss_idle,
        "rss_idle_35s_later_mb": round(run.daemon.rss_mb() - start, 1),
    }
