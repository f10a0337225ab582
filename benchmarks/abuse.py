"""Issue 10's abuse scenarios against a real `engined serve`, with the figures that bound them.

Each scenario starts a fresh daemon (ipc endpoints in a temporary directory, a systemd notify
socket with a 0.1 s watchdog), plays a hostile or careless client at full size while two
bystanders watch, and prints:

* stall: the longest gap between two outputs of a bystander's streaming request, and the
  longest silence of the watchdog (WATCHDOG=1 every 0.1 s when the loop turns);
* ping: a bystander's ping round trips during the scenario (p50 / p99 / max);
* rss: how much the daemon's resident memory grew;
* figures of the scenario's own (exit codes, counts, times).

    .venv/bin/python benchmarks/abuse.py [SCENARIO ...] [--scale 0.1] [--engined-root DIR]

`--scale` shrinks every size for a quick run; `--engined-root` runs the daemon from another
checkout (the code before a fix, say), everything else from this one. `--list` names the
scenarios. To add one (issue 10's defects 5, 6, 8, 9 and 10 are next), write
`async def name(run: Run) -> Figures` and decorate it with `@scenario(...)`: `run` holds the
daemon (endpoints, pid, RSS), `run.scaled(n)` and a zmq context; the bystanders measure
themselves (benchmarks/abuse_harness.py).

Figures measured on the project's shared 2-core machine are in the README ("Limits and
guarantees"); they vary with load, so compare before and after in one sitting.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import abuse_budgets  # noqa: F401  (registers issue 21's)
import abuse_clients  # noqa: F401  (registers defects 5, 6, 8, 9 and 10)
import abuse_identity  # noqa: F401  (registers issue 21's routing-id and connection scenarios)
import abuse_shutdown  # noqa: F401  (registers issue 21's defects 1, 3 and 4)
import msgspec
import zmq
import zmq.asyncio
from abuse_harness import (  # benchmarks/, beside this
    PACED,
    SCENARIOS,
    Figures,
    Run,
    flood,
    play,
    scenario,
    submit_many,
)

from engined.client import EngineClient
from engined.logs import configure_logging

# --- the scenarios ----------------------------------------------------------------------------


@scenario("ping-flood", 1, "100,000 pings from one client", *PACED)
async def ping_flood(run: Run) -> Figures:
    ping = msgspec.msgpack.encode({"type": "ping"})
    start = time.monotonic()
    await asyncio.to_thread(flood, run.daemon.control, [ping], run.scaled(100_000))
    return {"flood_s": round(time.monotonic() - start, 2)}


@scenario("garbage-flood", 1, "100,000 frames that are not msgpack", *PACED)
async def garbage_flood(run: Run) -> Figures:
    start = time.monotonic()
    await asyncio.to_thread(flood, run.daemon.control, [b"\xc1 not msgpack"], run.scaled(100_000))
    return {"flood_s": round(time.monotonic() - start, 2)}


@scenario(
    "late-rank",
    2,
    "20,000 queued requests at speedup 1 (no queue limit), then SIGTERM, --drain-timeout 1",
    "--speedup-ratio",
    "1",
    "--max-queued-requests",
    "0",
    "--drain-timeout",
    "1",
)
async def late_rank(run: Run) -> Figures:
    async with await EngineClient.connect(run.daemon.control, ctx=run.ctx) as client:
        codes = await submit_many(client, run.scaled(20_000), 64)
        start = time.monotonic()
        await client.ping(timeout=120)
        loaded_ping = time.monotonic() - start
    grown = run.rss_growth()  # before the daemon exits
    exit_s = run.daemon.stop(signal.SIGTERM)
    return {
        "rss_loaded_growth_mb": grown,
        "submits": codes,
        "ping_loaded_ms": round(1000 * loaded_ping, 1),
        "sigterm_exit_s": round(exit_s, 2),
    }


for ratio in ("100", "1000"):
    scenario(
        f"late-rank-x{ratio}",
        2,
        f"2,000 queued requests at speedup {ratio}: ping while every pass is late",
        "--speedup-ratio",
        ratio,
        "--max-queued-requests",
        "0",
    )(lambda run: _load(run, 2_000))


async def _load(run: Run, count: int) -> Figures:
    async with await EngineClient.connect(run.daemon.control, ctx=run.ctx) as client:
        codes = await submit_many(client, run.scaled(count), 256)
        samples = []
        for _ in range(50):
            start = time.monotonic()
            await client.ping(timeout=60)
            samples.append(time.monotonic() - start)
        samples.sort()
    return {"submits": codes, "ping_loaded_p50_ms": round(1000 * samples[len(samples) // 2], 2)}


@scenario(
    "replay-no-read",
    3,
    "20 DEALERs ask twice to replay a 10,000-batch buffer and never read",
    "--speedup-ratio",
    "0",
    "--block-size",
    "16",
    "--num-gpu-blocks",
    "512",
)
async def replay_no_read(run: Run) -> Figures:
    async with await EngineClient.connect(run.daemon.control, ctx=run.ctx) as client:
        for start in range(0, run.scaled(10_000), 100):
            await asyncio.gather(
                *(
                    client.generate([n * 1000 + t for t in range(64)], 1)
                    for n in range(start, start + 100)
                )
            )
        before = run.daemon.rss_mb()
        socks = []
        for _ in range(20):
            sock = run.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(run.daemon.endpoint("replay"))
            for _ in range(2):
                await sock.send_multipart([b"", (0).to_bytes(8, "big")])
            socks.append(sock)
        start = time.monotonic()
        for _ in range(100):  # 1 s of pings while the replays are asked for
            await client.ping(timeout=60)
        pings_s = time.monotonic() - start
        await asyncio.sleep(3)  # let the daemon queue whatever it is going to queue
        grown = run.daemon.rss_mb() - before
        for sock in socks:
            sock.close()
    return {"replay_rss_growth_mb": round(grown, 1), "100_pings_s": round(pings_s, 2)}


@scenario(
    "pub-no-read",
    4,
    "a KV subscriber that never reads, under load for 20 s",
    "--kv-replay-buffer",
    "10",
    "--speedup-ratio",
    "0",
    "--block-size",
    "16",
    "--num-gpu-blocks",
    "2048",
)
async def pub_no_read(run: Run) -> Figures:
    sub = run.ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVHWM, 10)
    sub.connect(run.daemon.endpoint("kv"))
    # (The daemon's replay buffer is kept small here, so the growth is the PUB's own.)
    before = run.daemon.rss_mb()
    deadline = time.monotonic() + 20 * run.scale
    n = 0
    async with await EngineClient.connect(run.daemon.control, ctx=run.ctx) as client:
        while time.monotonic() < deadline:
            await asyncio.gather(
                *(
                    client.generate([(n + i) * 10_000 + t for t in range(1024)], 1)
                    for i in range(32)
                )
            )
            n += 32
    grown = run.daemon.rss_mb() - before
    sub.close()
    return {"requests": n, "pub_rss_growth_mb": round(grown, 1)}


@scenario("queue-flood", 7, "100,000 submits at once (default queue limit)", *PACED)
async def queue_flood(run: Run) -> Figures:
    async with await EngineClient.connect(run.daemon.control, ctx=run.ctx) as client:
        codes = await submit_many(client, run.scaled(100_000), 64)
    return {"submits": codes}


@scenario("ipc-takeover", 11, "a second daemon on the same ipc:// paths")
async def ipc_takeover(run: Run) -> Figures:
    endpoints = {name: run.daemon.endpoint(name) for name in ("control", "kv", "fpm", "replay")}
    cmd = [sys.executable, "-m", "engined.cli", "serve", "--control-endpoint", endpoints["control"]]
    cmd += ["--kv-events-endpoint", endpoints["kv"], "--fpm-endpoint", endpoints["fpm"]]
    cmd += ["--kv-replay-endpoint", endpoints["replay"]]
    # A daemon that took the sockets over keeps running: give it 10 s, then stop it.
    second = subprocess.Popen(cmd, cwd=run.daemon.engined_root, stderr=subprocess.DEVNULL)
    try:
        code: int | str = second.wait(10)
    except subprocess.TimeoutExpired:
        code = "still running (took the sockets over)"
        second.terminate()
        second.wait(30)
    async with await EngineClient.connect(run.daemon.control, ctx=run.ctx) as client:
        try:
            await client.ping(timeout=5)
            first = "answers"
        except TimeoutError:
            first = "deaf"
    return {"second_exit_code": code, "first_daemon": first}


@scenario("bench-daemon-gone", 11, "engined bench --timeout 2 while the daemon is killed", *PACED)
async def bench_daemon_gone(run: Run) -> Figures:
    command = [sys.executable, "-m", "engined.cli", "bench", "--json"]
    command += ["--control-endpoint", run.daemon.control, "--requests", "200"]
    command += ["--concurrency", "8", "--output-len", "20", "--timeout", "2"]
    bench = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=run.daemon.engined_root,
    )
    async with await EngineClient.connect(run.daemon.control, ctx=run.ctx) as client:
        while (await client.stats(timeout=10)).ranks[0].passes_total < 100:
            await asyncio.sleep(0.05)
    assert run.daemon.proc is not None
    run.daemon.proc.kill()
    killed = run.daemon.exited_at = time.monotonic()
    out, _ = await asyncio.to_thread(bench.communicate, None, 600)
    return {
        "bench_exit_after_kill_s": round(time.monotonic() - killed, 1),
        "bench_exit_code": bench.returncode,
        "report_printed": b'"requests"' in out,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("scenarios", nargs="*", metavar="SCENARIO", help="default: all")
    parser.add_argument("--scale", type=float, default=1.0, help="multiply every size")
    parser.add_argument("--engined-root", type=Path, help="run the daemon from this checkout")
    parser.add_argument("--list", action="store_true", help="name the scenarios and exit")
    args = parser.parse_args()
    configure_logging("console", "warning")  # the client library's debug lines are noise here
    if args.list:
        for name, (defect, what, _, _) in SCENARIOS.items():
            print(f"{name:20} defect {defect:2}  {what}")
        return
    for name in args.scenarios or list(SCENARIOS):
        if name not in SCENARIOS:
            parser.error(f"unknown scenario {name!r}; --list names them")
        defect, _, daemon_args, fn = SCENARIOS[name]
        figures = asyncio.run(play(defect, daemon_args, fn, args.scale, args.engined_root))
        print(f"{name}: " + ", ".join(f"{k}={v}" for k, v in figures.items()), flush=True)


if __name__ == "__main__":
    main()
