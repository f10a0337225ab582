"""End-to-end throughput and pacing of a real `engined serve` process.

Throughput mode (default): the daemon runs with speedup 0 (no sleeping), one client process
keeps 256 requests in flight (prompt 512, output 256) over ipc and then tcp, and we print
output tokens/s, requests/s, KV messages/s and FPM messages/s, and the daemon's CPU per
output token, with its start-up and over the load alone. The client reads raw frames and
counts tokens without per-request queues, so it measures the daemon, not the client.

Pacing mode (`--pacing`): speedup 1, 4 ranks under load (prompt 256, output 64 unless
`--prompt`/`--output` say otherwise: the issue's real-time figure is `--ranks 8 --concurrency
512 --pacing-requests 1024 --prompt 512 --output 128`); prints how late passes started
against their planned deadlines (p50/p99/max), as the daemon measured them: first over all
passes (the daemon's `stats`, the lines every revision prints), then split into phases from a
per-pass record the daemon writes at exit (see _PACING_DAEMON):

* start-up: passes until every request in flight was admitted, i.e. until the first pass after
  which no rank had a waiting request and the ranks ran min(--concurrency, --pacing-requests)
  requests between them, plus each rank's next pass (its lateness is the overrun of a burst
  pass, since a pass's lateness is measured against the previous pass's modeled end);
* steady: from there until the first request finished with nothing left to submit;
* drain: the rest, in-flight requests finishing with none to replace them.

Then, of the steady passes later than 2 ms, how many waited on a CPU run queue for at least
half their lateness (their process's loop thread runnable, another thread on the core: the
pass record carries schedstat's run-queue time), so a tail the machine causes is told apart
from one the daemon's own work causes (`queue_waits`).

The load generator runs in a process of its own (multiprocessing, spawn), apart from both the
daemon and this measuring process. After the run, with no client connected, the daemon's CPU
over a 2 s idle window: `idle daemon cpu N% of a core` (utime + stime, and schedstat's ns).

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
import json
import multiprocessing
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TypeVar

import msgspec
import zmq
import zmq.asyncio

from engined.wire import control as wire
from engined.wire.control import ReplyDecoder, encode_message

T = TypeVar("T")

# The idle-CPU window of pacing mode, and how long after the run it starts.
IDLE_WINDOW_S = 2.0
IDLE_SETTLE_S = 0.5
# Steady passes later than this are checked against their process's run-queue wait since
# before their deadline (see `queue_waits`).
LATE_MS = 2.0


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
    """User + system CPU a process and its live children (rank worker processes) have used
    (Linux /proc), or None elsewhere.

    Less sensitive to other load on the machine than wall-clock throughput, so it is the number
    to compare when a change costs a few percent.
    """
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        return None
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return own + sum(cpu_seconds(int(child)) or 0.0 for child in children)


def start(
    endpoints: dict[str, str],
    extra: list[str],
    program: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> subprocess.Popen[bytes]:
    """The daemon, from the `engined` this interpreter imports (PYTHONPATH, then the install).

    `-c` with `engined.cli.main` rather than `-m engined` or `-m engined.cli`: every revision
    has that function, whether `engined.cli` is a module or a package and with or without a
    `__main__` (benchmarks/compare.py runs old revisions' code with this interpreter).
    """
    program = program or ["-c", "from engined.cli import main; main()"]
    cmd = [sys.executable, *program, "serve", "--log-format", "json", *no_api_server_flags()]
    for flag, value in endpoints.items():
        cmd += [flag, value]
    return subprocess.Popen(cmd + extra, stderr=subprocess.DEVNULL, env=env)


async def while_alive(proc: subprocess.Popen[bytes], work: Awaitable[T]) -> T:
    """`work`'s result, unless the daemon exits first: then stop with its exit code instead of
    waiting forever for replies that cannot come (a daemon that refuses its flags, say)."""
    task = asyncio.ensure_future(work)
    while not task.done():
        await asyncio.wait([task], timeout=0.2)
        if not task.done() and proc.poll() is not None:
            task.cancel()
            raise SystemExit(f"the daemon exited with code {proc.returncode} during the run")
    return task.result()


def no_api_server_flags() -> list[str]:
    """`--port ""` for a revision with an OpenAI API server (on port 8000 by default): the
    benchmark drives the control socket only, and two runs at once would collide on the port."""
    from engined.config import DaemonConfig

    return ["--port", ""] if "api_port" in DaemonConfig.__struct_fields__ else []


def rank_process_flags(processes: int) -> list[str]:
    """`--rank-processes N` for a daemon that has the setting (its default became -1, one
    worker per core, so the benchmark names what it measures); nothing for a revision from
    before rank processes, where every rank runs in the daemon's process anyway."""
    from engined.config import DaemonConfig

    if "rank_processes" in DaemonConfig.__struct_fields__:
        return ["--rank-processes", str(processes)]
    if processes:
        raise SystemExit("this revision of engined has no --rank-processes")
    return []


def realtime_flags(priority: int) -> list[str]:
    """`--realtime-priority N` when asked for (0, the default, passes nothing, so that every
    revision runs); a revision without the setting cannot honour it."""
    from engined.config import DaemonConfig

    if not priority:
        return []
    if "realtime_priority" not in DaemonConfig.__struct_fields__:
        raise SystemExit("this revision of engined has no --realtime-priority")
    return ["--realtime-priority", str(priority)]


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
    daemon_pid: int | None = None,
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
    # The daemon's CPU so far (its start-up) is left out of the load's own figure.
    cpu_at_start = cpu_seconds(daemon_pid) if daemon_pid is not None else None
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
        **({"cpu_at_start": cpu_at_start} if cpu_at_start is not None else {}),
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
                *(["--data-parallel-size", str(args.dp_size)] if args.dp_size > 1 else []),
                *rank_process_flags(args.rank_processes),
            ],
        )
        try:
            r = asyncio.run(
                while_alive(
                    proc,
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
                        proc.pid,
                    ),
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
            # Includes start-up (0.3-0.5 s of imports and set-up, more in later revisions):
            # the figure every revision prints, so compare.py can set any two side by side.
            print(
                f"[{transport}]   daemon CPU        {cpu:>12.2f} s "
                f"({cpu / r['tokens'] * 1e6:.2f} µs per output token)"
            )
            if "cpu_at_start" in r:
                load_cpu = cpu - r["cpu_at_start"]
                print(
                    f"[{transport}]   daemon CPU, load  {load_cpu:>12.2f} s "
                    f"({load_cpu / r['tokens'] * 1e6:.2f} µs per output token, start-up left out)"
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
    shutil.rmtree(tmp, ignore_errors=True)


# Run as the daemon in pacing mode (`python -c _PACING_DAEMON serve ...`): the same `engined
# serve`, plus a record of every pass for the steady-state split, written to the file named by
# E2E_BENCH_PASS_LOG at exit. It reads only the loop's public attributes: each appended
# `lateness_ms` value (the daemon's own measurement) with the monotonic time of its pass start,
# and, through a `pass_observers` entry, the rank's running/waiting counts after each pass.
# Cost: a timestamp and a list append per pass. Without those attributes it records nothing.
# Rank worker processes (where the tree has them) run the same recorder (`_PASS_RECORDER`),
# each into E2E_BENCH_PASS_LOG.<pid>: the daemon starts them through
# `rank_process.WORKER_COMMAND`, which it reads at each start, so the wrapper swaps it.
# CLOCK_MONOTONIC is one clock for all processes, so the records merge by time.
_PASS_RECORDER = """
import atexit, collections, json, os, time
try:
    from engined.server.ranks import engine_loop
except ImportError:  # a revision from before engined/server/ had sub-packages
    from engined.server import engine_loop

lateness, states = [], []
# The time this (the loop's) thread has waited on a CPU run queue while runnable, in ns:
# schedstat's second field, read with one pread per pass (-1 where there is none).
try:
    _schedstat = os.open("/proc/thread-self/schedstat", os.O_RDONLY)
except OSError:
    _schedstat = None
# Read once: getpid is a system call, and this process is never forked.
_pid = os.getpid()

def _run_queue_ns():
    if _schedstat is None:
        return -1
    try:
        return int(os.pread(_schedstat, 256, 0).split()[1])
    except (OSError, IndexError, ValueError):
        return -1

class _Recorded(collections.deque):
    def __init__(self, rank, values):
        super().__init__(values, maxlen=values.maxlen)
        self.rank = rank

    def append(self, value):
        lateness.append((self.rank, time.monotonic(), value, _run_queue_ns(), _pid))
        super().append(value)

def _observe(rank, start_ms, result):
    m = result.metrics
    states.append((rank, time.monotonic(), m.running, m.waiting))

_init = engine_loop.EngineLoop.__init__

def _recording_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    try:
        self.lateness_ms = _Recorded(self.rank, self.lateness_ms)
        self.pass_observers.append(_observe)
    except AttributeError:
        pass

engine_loop.EngineLoop.__init__ = _recording_init

def _dump_to(path):
    @atexit.register
    def _dump():
        with open(path, "w") as f:
            json.dump({"lateness": lateness, "states": states}, f)
"""
_PACING_DAEMON = (
    _PASS_RECORDER
    + """
import sys
_dump_to(os.environ["E2E_BENCH_PASS_LOG"])
try:
    from engined.server.ranks import rank_process
except ImportError:
    try:
        from engined.server import rank_process
    except ImportError:
        rank_process = None
if rank_process is not None and hasattr(rank_process, "WORKER_COMMAND"):
    rank_process.WORKER_COMMAND = (sys.executable, "-c", _WORKER)
from engined.cli import main
main()
"""
)
# The worker's program: the recorder, then the rank worker's own entry point.
_PACING_WORKER = (
    _PASS_RECORDER
    + """
import sys
_dump_to(f"{os.environ['E2E_BENCH_PASS_LOG']}.{os.getpid()}")
try:
    from engined.server.ranks.rank_worker import main
except ImportError:
    from engined.server.rank_worker import main
sys.exit(main())
"""
)


def generate_load(
    control: str, total: int, concurrency: int, prompt: int, output: int, report: Connection
) -> None:
    """The pacing load generator, in a process of its own: the daemon's CPU is what we measure,
    and this one's CPU (encoding, decoding, asyncio) must not share an event loop with the
    measurement. Sends back monotonic times: the first submit, `drain` (the first finish with
    nothing left to submit, so in-flight requests drop below the concurrency for good) and
    the last finish.
    """
    import logging

    import structlog

    from engined.client import EngineClient

    # The ping loop below times out while the daemon starts; its late replies are not news.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))

    async def run() -> dict[str, float]:
        async with await EngineClient.connect(control) as client:
            for _ in range(200):
                with contextlib.suppress(TimeoutError):
                    await client.ping(timeout=0.1)
                    break
            rng = random.Random(1)
            sem = asyncio.Semaphore(concurrency)
            times: dict[str, float] = {}
            admitted = 0

            async def one(n: int) -> None:
                nonlocal admitted
                async with sem:
                    admitted += 1
                    tokens = [rng.randrange(50_000) for _ in range(prompt)]
                    times.setdefault("start", time.monotonic())
                    await client.generate(tokens, output, timeout=120)
                    if admitted == total:
                        times.setdefault("drain", time.monotonic())

            await asyncio.gather(*(one(n) for n in range(total)))
            times["end"] = time.monotonic()
            return times

    report.send(asyncio.run(run()))
    report.close()


def lateness_summary(values: list[float]) -> tuple[float, float, float]:
    """p50, p99, max, with the daemon's own rank rule (`LatenessWindow.summary`)."""
    if not values:
        return (0.0, 0.0, 0.0)
    ordered = sorted(values)
    n = len(ordered)
    return ordered[n // 2], ordered[min(n - 1, (99 * n) // 100)], ordered[-1]


def read_pass_logs(path: Path) -> dict[str, list[list[float]]] | None:
    """The daemon's pass record merged with its rank workers' (`path.<pid>`), or None."""
    found = [path, *sorted(path.parent.glob(f"{path.name}.*"))]
    logs = [json.loads(p.read_text()) for p in found if p.exists()]
    if not logs:
        return None
    return {key: [row for log in logs for row in log[key]] for key in ("lateness", "states")}


def steady_start(states: list[list[float]], target: int) -> float | None:
    """When every request in flight was first admitted: the monotonic time of the pass after
    which no rank had a waiting request and the ranks ran `target` requests between them."""
    latest: dict[int, tuple[int, int]] = {}
    for rank, at, running, waiting in sorted(states, key=lambda s: s[1]):
        latest[int(rank)] = (int(running), int(waiting))
        if sum(r for r, _ in latest.values()) >= target and all(w == 0 for _, w in latest.values()):
            return at
    return None


def phases(
    log: dict[str, list[list[float]]], target: int, drain: float
) -> tuple[float | None, dict[str, dict[int, list[float]]]]:
    """Each rank's lateness values split into start-up, steady and drain (see the module doc)."""
    t0 = steady_start(log["states"], target)
    split: dict[str, dict[int, list[float]]] = {"start-up": {}, "steady": {}, "drain": {}}
    for name in split.values():
        for row in log["lateness"]:
            name.setdefault(int(row[0]), [])
    for phase, row in classified(log, t0, drain):
        split[phase][int(row[0])].append(row[2])
    return t0, split


def classified(
    log: dict[str, list[list[float]]], t0: float | None, drain: float
) -> list[tuple[str, list[float]]]:
    """Each lateness row (rank, time, ms, ...) with its phase, in the record's order."""
    rows: list[tuple[str, list[float]]] = []
    first_after: set[int] = set()
    for row in log["lateness"]:
        rank, at = int(row[0]), row[1]
        if t0 is None or at <= t0:
            phase = "start-up"
        elif rank not in first_after:
            # Its lateness is the previous pass's overrun, and that pass was in the burst.
            first_after.add(rank)
            phase = "start-up"
        elif at < drain:
            phase = "steady"
        else:
            phase = "drain"
        rows.append((phase, row))
    return rows


def queue_waits(
    log: dict[str, list[list[float]]], t0: float | None, drain: float
) -> tuple[int, int] | None:
    """(steady passes later than LATE_MS, those whose process's loop thread waited on a CPU
    run queue for at least half their lateness between its last reading before the pass's
    deadline and the pass's start), or None when the record has no run-queue readings (no
    schedstat, or an older record).

    Such a pass was late because the machine's other threads had the core: nothing the
    daemon does about its passes would have started it on time.
    """
    rows = [row for row in log["lateness"] if len(row) >= 5 and row[3] >= 0]
    if not rows:
        return None
    by_process: dict[float, list[list[float]]] = {}
    for row in sorted(rows, key=lambda r: r[1]):
        by_process.setdefault(row[4], []).append(row)
    late = waited = 0
    for phase, row in classified(log, t0, drain):
        if phase != "steady" or row[2] <= LATE_MS or len(row) < 5 or row[3] < 0:
            continue
        late += 1
        deadline = row[1] - row[2] / 1000
        before = [r for r in by_process[row[4]] if r[1] <= deadline]
        if before and (row[3] - before[-1][3]) / 1e6 >= row[2] / 2:
            waited += 1
    return late, waited


async def rank_stats(control: str) -> list[wire.RankStats]:
    from engined.client import EngineClient

    async with await EngineClient.connect(control) as client:
        return (await client.stats()).ranks


def run_ns(pid: int) -> int | None:
    """Nanoseconds on a CPU of all the process's threads (/proc schedstat), or None."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        return sum(int((task / "schedstat").read_text().split()[0]) for task in tasks)
    except (OSError, ValueError, IndexError):
        return None


def idle_cpu(pid: int, window: float) -> tuple[float, float | None] | None:
    """Percent of one core the daemon used over `window` seconds with no client connected:
    from utime + stime (/proc stat, clock ticks: 1 tick / window of resolution) and, where
    available, from the scheduler's nanosecond run times."""
    before, before_ns = cpu_seconds(pid), run_ns(pid)
    time.sleep(window)
    after, after_ns = cpu_seconds(pid), run_ns(pid)
    if before is None or after is None:
        return None
    precise = None
    if before_ns is not None and after_ns is not None:
        precise = (after_ns - before_ns) / 1e9 / window * 100
    return (after - before) / window * 100, precise


def pacing(args: argparse.Namespace) -> None:
    tmp = tempfile.mkdtemp(prefix="engined-bench-")
    endpoints = {
        "--control-endpoint": f"ipc://{tmp}/control",
        "--kv-events-endpoint": f"ipc://{tmp}/kv",
        "--fpm-endpoint": f"ipc://{tmp}/fpm",
    }
    pass_log = Path(tmp) / "passes.json"
    proc = start(
        endpoints,
        [
            "--speedup-ratio",
            "1",
            "--block-size",
            "16",
            "--data-parallel-size",
            str(args.ranks),
            *rank_process_flags(args.rank_processes),
            *realtime_flags(args.realtime_priority),
        ],
        program=["-c", f"_WORKER = {_PACING_WORKER!r}\n" + _PACING_DAEMON],
        env={**os.environ, "E2E_BENCH_PASS_LOG": str(pass_log)},
    )
    # Pacing's own defaults (256, 64) unless given: old command lines keep their workload.
    prompt = 256 if args.prompt is None else args.prompt
    output = 64 if args.output is None else args.output
    idle: tuple[float, float | None] | None = None
    try:
        mp = multiprocessing.get_context("spawn")
        ours, theirs = mp.Pipe(duplex=False)
        generator = mp.Process(
            target=generate_load,
            args=(
                endpoints["--control-endpoint"],
                args.pacing_requests,
                args.concurrency,
                prompt,
                output,
                theirs,
            ),
            name="load-generator",
        )
        generator.start()
        theirs.close()
        try:
            times: dict[str, float] = ours.recv()
        except EOFError:
            raise SystemExit(
                f"the load generator failed (exit code {generator.exitcode})"
            ) from None
        generator.join()
        ranks = asyncio.run(while_alive(proc, rank_stats(endpoints["--control-endpoint"])))
        time.sleep(IDLE_SETTLE_S)
        idle = idle_cpu(proc.pid, IDLE_WINDOW_S)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
    print(
        f"pacing: speedup 1, {args.ranks} ranks, {args.pacing_requests} requests "
        f"(prompt {prompt}, output {output})"
        + (f", SCHED_FIFO priority {args.realtime_priority}" if args.realtime_priority else "")
    )
    for r in ranks:
        print(
            f"  rank {r.dp_rank}: passes {r.passes_total}, pass-start lateness ms "
            f"p50 {r.lateness_p50_ms:.3f}  p99 {r.lateness_p99_ms:.3f}  max {r.lateness_max_ms:.3f}"
        )
    target = min(args.concurrency, args.pacing_requests)
    log = read_pass_logs(pass_log)
    shutil.rmtree(tmp, ignore_errors=True)
    if log is None:
        print("steady state: n/a (the daemon wrote no pass log)")
    else:
        t0, split = phases(log, target, times["drain"])
        if t0 is None:
            print(f"steady state: n/a (the ranks never ran {target} requests with none waiting)")
        else:
            print(
                f"steady state: from {(t0 - times['start']) * 1000:.0f} ms after the first "
                f"submit (all {target} requests in flight admitted, none waiting; and each "
                f"rank's next pass) to {(times['drain'] - times['start']) * 1000:.0f} ms "
                "(the first finish with nothing left to submit)"
            )
        for phase in ("steady", "start-up", "drain"):
            for rank, values in sorted(split[phase].items()):
                p50, p99, worst = lateness_summary(values)
                print(
                    f"  {phase} rank {rank}: passes {len(values)}, pass-start lateness ms "
                    f"p50 {p50:.3f}  p99 {p99:.3f}  max {worst:.3f}"
                )
        waits = queue_waits(log, t0, times["drain"])
        if waits is not None:
            late, waited = waits
            print(
                f"steady passes later than {LATE_MS:g} ms: {late}; {waited} of them waited on "
                "the CPU run queue (schedstat) for at least half their lateness since before "
                "their deadline: other threads had the core"
            )
    if idle is not None:
        ticks, precise = idle
        resolution = 100 / os.sysconf("SC_CLK_TCK") / IDLE_WINDOW_S
        exact = f"; {precise:.3f}% from schedstat" if precise is not None else ""
        print(
            f"idle daemon cpu {ticks:.1f}% of a core ({args.ranks} ranks, {IDLE_WINDOW_S:.0f} s "
            f"window {IDLE_SETTLE_S:.1f} s after the run, no client; utime+stime, resolution "
            f"{resolution:.1f}%{exact})"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument(
        "--prompt", type=int, default=None, help="prompt tokens (512; with --pacing 256)"
    )
    parser.add_argument(
        "--output", type=int, default=None, help="output tokens (256; with --pacing 64)"
    )
    parser.add_argument("--pacing", action="store_true")
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument(
        "--dp-size", type=int, default=1, help="throughput mode: the daemon's data-parallel ranks"
    )
    parser.add_argument(
        "--rank-processes",
        type=int,
        default=0,
        help="the daemon's --rank-processes (0: ranks in its own process; with --pacing each "
        "worker records its passes too)",
    )
    parser.add_argument(
        "--realtime-priority",
        type=int,
        default=0,
        help="with --pacing: the daemon's --realtime-priority (SCHED_FIFO; 0 = normal)",
    )
    parser.add_argument("--pacing-requests", type=int, default=256)
    parser.add_argument(
        "--http-port", type=int, default=None, help="serve and scrape /metrics (0 = a free port)"
    )
    parser.add_argument("--scrape-interval", type=float, default=0.1)
    args = parser.parse_args()
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if not args.pacing:
        args.prompt = 512 if args.prompt is None else args.prompt
        args.output = 256 if args.output is None else args.output
    pacing(args) if args.pacing else throughput(args)


if __name__ == "__main__":
    main()
