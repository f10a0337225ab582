"""End-to-end throughput and pacing of a real `engined serve` process.

Throughput mode (default): the daemon runs with speedup 0 (no sleeping), one client process
keeps 256 requests in flight (prompt 512, output 256) over ipc and then tcp, and we print
output tokens/s, requests/s, KV messages/s and FPM messages/s. The client reads raw frames
and counts tokens without per-request queues, so it measures the daemon, not the client.

Pacing mode (`--pacing`): speedup 1, 4 ranks under load; prints how late passes started
against their planned deadlines (p50/p99/max), as the daemon measured them.

`--http-port PORT` (0 = any free port) turns Prometheus metrics on and scrapes `/metrics` every
`--scrape-interval` seconds during the run (0.1 s: far more often than any Prometheus), then
checks `vllm:generation_tokens_total` against the tokens the client counted. Compare with a
run without it to see what metrics cost.

    .venv/bin/python benchmarks/e2e_throughput.py [--requests 1024] [--pacing] [--http-port 0]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import msgspec
import zmq
import zmq.asyncio

from engined.wire import control as wire
from engined.wire.control import ReplyDecoder, encode_message


class _Entry(msgspec.Struct):
    request_id: str
    token_ids: list[int]
    finished: bool


class _Output(msgspec.Struct, tag_field="type", tag="output"):
    dp_rank: int
    outputs: list[_Entry]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU a process has used (Linux /proc), or None elsewhere.

    Less sensitive to other load on the machine than wall-clock throughput, so it is the number
    to compare when a change costs a few percent.
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start(endpoints: dict[str, str], extra: list[str]) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "engined.cli", "serve", "--log-format", "json"]
    for flag, value in endpoints.items():
        cmd += [flag, value]
    return subprocess.Popen(cmd + extra, stderr=subprocess.DEVNULL)


async def counter(
    ctx: zmq.asyncio.Context, endpoint: str, counts: dict[str, int], key: str
) -> None:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.RCVHWM, 0)
    sub.connect(endpoint)
    try:
        while True:
            await sub.recv_multipart(copy=False)
            counts[key] += 1
    finally:
        sub.close()


async def http_get(port: int, path: str) -> tuple[bytes, float]:
    """(body, seconds) of one GET over a fresh connection (the daemon closes it)."""
    start = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: bench\r\n\r\n".encode())
    data = await reader.read()
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise RuntimeError(f"GET {path}: {head[:40]!r}")
    return body, time.perf_counter() - start


async def scraper(port: int, interval: float, latencies: list[float]) -> None:
    while True:
        _, seconds = await http_get(port, "/metrics")
        latencies.append(seconds)
        await asyncio.sleep(interval)


def generation_tokens(body: bytes) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    return sum(
        sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
        if sample.name == "vllm:generation_tokens_total"
    )


async def drive(
    control: str,
    kv: str,
    fpm: str,
    total: int,
    concurrency: int,
    prompt: int,
    output: int,
    http_port: int | None = None,
    scrape_interval: float = 0.1,
) -> dict[str, float]:
    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(control)
    replies = ReplyDecoder()
    out_decoder = msgspec.msgpack.Decoder(_Output)
    # Wait for the daemon.
    for attempt in range(200):
        await sock.send(encode_message(wire.Ping(id=attempt)))
        if await sock.poll(100):
            await sock.recv()
            break
    counts = {"kv": 0, "fpm": 0}
    tasks = [
        asyncio.create_task(counter(ctx, kv, counts, "kv")),
        asyncio.create_task(counter(ctx, fpm, counts, "fpm")),
    ]
    scrapes: list[float] = []
    if http_port is not None:
        tasks.append(asyncio.create_task(scraper(http_port, scrape_interval, scrapes)))
    rng = random.Random(0)
    shared = [rng.randrange(50_000) for _ in range(prompt // 2)]
    bodies = [
        encode_message(
            wire.Submit(
                id=n,
                request=wire.WireRequest(
                    token_ids=shared + [rng.randrange(50_000) for _ in range(prompt - prompt // 2)],
                    max_tokens=output,
                    request_id=f"r{n}",
                ),
            )
        )
        for n in range(total)
    ]
    sent = tokens = finished = 0
    start = time.perf_counter()
    for _ in range(min(concurrency, total)):
        await sock.send(bodies[sent])
        sent += 1
    while finished < total:
        body = await sock.recv()
        if body[:1] and b"output" in body[:24]:
            msg = out_decoder.decode(body)
            for entry in msg.outputs:
                tokens += len(entry.token_ids)
                if entry.finished:
                    finished += 1
                    if sent < total:
                        await sock.send(bodies[sent])
                        sent += 1
        else:
            reply = replies.decode(body)
            if isinstance(reply, wire.ErrorReply):
                raise RuntimeError(f"{reply.code}: {reply.message}")
    elapsed = time.perf_counter() - start
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task
    sock.close()
    ctx.term()
    metrics: dict[str, float] = {}
    if http_port is not None:
        body, _ = await http_get(http_port, "/metrics")
        scrapes.sort()
        metrics = {
            "scrapes": len(scrapes),
            "scrape_p50_ms": scrapes[len(scrapes) // 2] * 1000 if scrapes else 0.0,
            "scrape_max_ms": scrapes[-1] * 1000 if scrapes else 0.0,
            "metric_tokens": generation_tokens(body),
        }
    return {
        "elapsed": elapsed,
        "tokens": tokens,
        "requests": total,
        "kv": counts["kv"],
        "fpm": counts["fpm"],
        **metrics,
    }


def throughput(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="engined-bench-")
    http_port = args.http_port or (free_port() if args.http_port == 0 else None)
    for transport in ("ipc", "tcp"):
        if transport == "ipc":
            endpoints = {
                "--control-endpoint": f"ipc://{tmp}/control",
                "--kv-events-endpoint": f"ipc://{tmp}/kv",
                "--fpm-endpoint": f"ipc://{tmp}/fpm",
            }
        else:
            endpoints = {
                "--control-endpoint": f"tcp://127.0.0.1:{free_port()}",
                "--kv-events-endpoint": f"tcp://127.0.0.1:{free_port()}",
                "--fpm-endpoint": f"tcp://127.0.0.1:{free_port()}",
            }
        proc = start(
            endpoints,
            [
                "--speedup-ratio",
                "0",
                "--block-size",
                "16",
                "--num-gpu-blocks",
                "16384",
                "--max-num-seqs",
                str(args.concurrency),
                *(["--http-port", str(http_port)] if http_port is not None else []),
            ],
        )
        try:
            r = asyncio.run(
                drive(
                    endpoints["--control-endpoint"],
                    endpoints["--kv-events-endpoint"],
                    endpoints["--fpm-endpoint"],
                    args.requests,
                    args.concurrency,
                    args.prompt,
                    args.output,
                    http_port,
                    args.scrape_interval,
                )
            )
            cpu = cpu_seconds(proc.pid)
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        e = r["elapsed"]
        print(
            f"[{transport}] {args.requests} requests, concurrency {args.concurrency}, "
            f"prompt {args.prompt}, output {args.output}"
        )
        print(f"[{transport}]   output tokens/s   {r['tokens'] / e:>12,.0f}")
        print(f"[{transport}]   requests/s        {r['requests'] / e:>12,.1f}")
        print(f"[{transport}]   KV messages/s     {r['kv'] / e:>12,.0f}")
        print(f"[{transport}]   FPM messages/s    {r['fpm'] / e:>12,.0f}")
        print(f"[{transport}]   wall time         {e:>12.2f} s")
        if cpu is not None:
            # Includes start-up (about 0.2 s of imports), the same in every run.
            print(
                f"[{transport}]   daemon CPU        {cpu:>12.2f} s "
                f"({cpu / r['tokens'] * 1e6:.2f} µs per output token)"
            )
        if http_port is not None:
            print(
                f"[{transport}]   /metrics          {r['scrapes']:.0f} scrapes during the run, "
                f"p50 {r['scrape_p50_ms']:.1f} ms, max {r['scrape_max_ms']:.1f} ms"
            )
            check = "matches" if r["metric_tokens"] == r["tokens"] else "DIFFERS FROM"
            print(
                f"[{transport}]   generation_tokens_total {r['metric_tokens']:,.0f} {check} "
                f"the client's {r['tokens']:,.0f}"
            )


async def pacing_run(
    control: str, total: int, concurrency: int, prompt: int, output: int, ranks: int
) -> list[wire.RankStats]:
    from engined.client import EngineClient

    async with await EngineClient.connect(control) as client:
        for _ in range(200):
            with contextlib.suppress(TimeoutError):
                await client.ping(timeout=0.1)
                break
        rng = random.Random(1)
        sem = asyncio.Semaphore(concurrency)

        async def one(n: int) -> None:
            async with sem:
                tokens = [rng.randrange(50_000) for _ in range(prompt)]
                await client.generate(tokens, output, timeout=120)

        await asyncio.gather(*(one(n) for n in range(total)))
        return (await client.stats()).ranks


def pacing(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="engined-bench-")
    endpoints = {
        "--control-endpoint": f"ipc://{tmp}/control",
        "--kv-events-endpoint": f"ipc://{tmp}/kv",
        "--fpm-endpoint": f"ipc://{tmp}/fpm",
    }
    proc = start(
        endpoints,
        ["--speedup-ratio", "1", "--block-size", "16", "--data-parallel-size", str(args.ranks)],
    )
    try:
        ranks = asyncio.run(
            pacing_run(
                endpoints["--control-endpoint"],
                args.pacing_requests,
                args.concurrency,
                256,
                64,
                args.ranks,
            )
        )
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    print(
        f"pacing: speedup 1, {args.ranks} ranks, {args.pacing_requests} requests "
        "(prompt 256, output 64)"
    )
    for r in ranks:
        print(
            f"  rank {r.dp_rank}: passes {r.passes_total}, pass-start lateness ms "
            f"p50 {r.lateness_p50_ms:.3f}  p99 {r.lateness_p99_ms:.3f}  max {r.lateness_max_ms:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--output", type=int, default=256)
    parser.add_argument("--pacing", action="store_true")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--pacing-requests", type=int, default=256)
    parser.add_argument(
        "--http-port", type=int, default=None, help="serve and scrape /metrics (0 = a free port)"
    )
    parser.add_argument("--scrape-interval", type=float, default=0.1)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    pacing(args) if args.pacing else throughput(args)


if __name__ == "__main__":
    main()
