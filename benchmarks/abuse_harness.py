"""The harness of benchmarks/abuse.py: a daemon in a temporary directory, two bystanders in a
process of their own (a streaming client and a pinging one, plus systemd's side of the
watchdog), and what they measured while a scenario ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from pathlib import Path

import zmq
import zmq.asyncio

from engined.client import EngineClient, EngineError

Figures = dict[str, object]
WATCHDOG_USEC = 200_000


# --- the daemon and its bystanders ------------------------------------------------------------


class Watchdog:
    """The systemd side of NOTIFY_SOCKET: times of the WATCHDOG=1 datagrams (a thread)."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.sock.settimeout(0.2)
        self.pings: list[float] = []
        self._stop = False
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        while not self._stop:
            with contextlib.suppress(TimeoutError):
                if b"WATCHDOG=1" in self.sock.recv(4096):
                    self.pings.append(time.monotonic())

    def longest_silence(self, since: float, until: float | None) -> float:
        end = time.monotonic() if until is None else until
        times = [since, *(t for t in self.pings if since <= t <= end), end]
        return max(b - a for a, b in itertools.pairwise(times))

    def close(self) -> None:
        self._stop = True
        self._thread.join()
        self.sock.close()


@dataclass
class Daemon:
    root: Path
    args: list[str]
    engined_root: Path | None
    proc: subprocess.Popen[bytes] | None = None
    exited_at: float | None = None

    def endpoint(self, name: str) -> str:
        return f"ipc://{self.root}/{name}"

    @property
    def control(self) -> str:
        return self.endpoint("control")

    def start(self, *extra: str) -> None:
        env = {**os.environ, "NOTIFY_SOCKET": str(self.root / "notify")}
        env["WATCHDOG_USEC"] = str(WATCHDOG_USEC)
        if self.engined_root is not None:
            env["PYTHONPATH"] = str(self.engined_root)
        cmd = [sys.executable, "-m", "engined.cli", "serve", "--log-format", "json"]
        for flag, name in (("control", "control"), ("kv-events", "kv"), ("fpm", "fpm")):
            cmd += [f"--{flag}-endpoint", self.endpoint(name)]
        cmd += ["--kv-replay-endpoint", self.endpoint("replay"), *self.args, *extra]
        cwd = self.engined_root or Path(__file__).resolve().parents[1]
        log = (self.root / "engined.log").open("ab")
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)

    def rss_mb(self) -> float:
        """Resident memory now (nan once the process has exited)."""
        assert self.proc is not None
        with contextlib.suppress(OSError):
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> float:
        """Seconds from the signal to the exit."""
        assert self.proc is not None
        start = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.exited_at is None:
            self.exited_at = time.monotonic()
        return time.monotonic() - start


async def wait_ready(endpoint: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    async with await EngineClient.connect(endpoint) as client:
        while True:
            try:
                await client.ping(timeout=0.5)
                return
            except TimeoutError:
                if time.monotonic() > deadline:
                    raise


@dataclass
class Bystanders:
    """A client streaming one long request, and one pinging, both timed."""

    output_times: list[float] = field(default_factory=list)
    pings: list[float] = field(default_factory=list)
    stream_ended: float | None = None  # the request finished (a small pool caps its length)

    async def stream(self, client: EngineClient) -> None:
        with contextlib.suppress(EngineError, TimeoutError):
            await client.submit(list(range(64)), 100_000, request_id="bystander", timeout=30)
            async for _ in client.outputs("bystander", timeout=60):
                self.output_times.append(time.monotonic())
            self.stream_ended = time.monotonic()

    async def ping(self, client: EngineClient) -> None:
        while True:
            start = time.monotonic()
            try:
                await client.ping(timeout=60)
            except TimeoutError:
                self.pings.append(60.0)
            else:
                self.pings.append(time.monotonic() - start)
            # Pacing the probe, not waiting for anything.
            await asyncio.sleep(0.01)

    def figures(self, since: float, until: float | None) -> Figures:
        """Gaps and pings from `since` until the stream ended or the daemon exited."""
        ends = [t for t in (self.stream_ended, until) if t is not None]
        end = min(ends) if ends else time.monotonic()
        times = [since, *(t for t in self.output_times if t >= since), max(end, since)]
        gaps = [b - a for a, b in itertools.pairwise(times)]
        pings = sorted(self.pings) or [float("nan")]
        return {
            "stream_longest_gap_s": round(max(gaps), 3),
            "ping_p50_ms": round(1000 * pings[len(pings) // 2], 2),
            "ping_p99_ms": round(1000 * pings[min(len(pings) - 1, 99 * len(pings) // 100)], 2),
            "ping_max_ms": round(1000 * pings[-1], 2),
        }


@dataclass
class Run:
    daemon: Daemon
    scale: float
    ctx: zmq.asyncio.Context
    rss_before: float = 0.0

    def rss_growth(self) -> float:
        return round(self.daemon.rss_mb() - self.rss_before, 1)

    def scaled(self, n: int) -> int:
        return max(1, round(n * self.scale))


def bystanders(control: str, notify: str, conn: Connection) -> None:
    """The bystanders' process: they must not share an event loop (or the GIL) with the
    abuser, or they would time the abuser's client instead of the daemon."""

    async def main() -> None:
        watchdog = Watchdog(notify)
        watchers = Bystanders()
        async with (
            await EngineClient.connect(control) as streamer,
            await EngineClient.connect(control) as prober,
        ):
            tasks = [
                asyncio.create_task(watchers.stream(streamer)),
                asyncio.create_task(watchers.ping(prober)),
            ]
            while not watchers.output_times:  # the stream is flowing
                await asyncio.sleep(0.01)
            conn.send("flowing")
            since, until = await asyncio.to_thread(conn.recv)
            figures = watchers.figures(since, until)
            silence = watchdog.longest_silence(since, until)
            figures["watchdog_longest_silence_s"] = round(silence, 3)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        watchdog.close()
        conn.send(figures)

    asyncio.run(main())


async def play(
    defect: int,
    args: list[str],
    fn: Callable[[Run], Awaitable[Figures]],
    scale: float,
    engined_root: Path | None,
) -> Figures:
    """Run one scenario against a fresh daemon; its figures, the bystanders' and the RSS growth."""
    with tempfile.TemporaryDirectory(prefix="engined-abuse-") as tmp:
        daemon = Daemon(Path(tmp), args, engined_root)
        daemon.start()
        ctx = zmq.asyncio.Context()
        ours, theirs = multiprocessing.Pipe()
        watcher = multiprocessing.get_context("spawn").Process(
            target=bystanders, args=(daemon.control, str(daemon.root / "notify"), theirs)
        )
        try:
            await wait_ready(daemon.control)
            watcher.start()
            assert await asyncio.to_thread(ours.recv) == "flowing"
            run = Run(daemon, scale, ctx, rss_before=daemon.rss_mb())
            since = time.monotonic()
            own = await fn(run)
            rss = run.rss_growth()
            ours.send((since, daemon.exited_at or time.monotonic()))
            figures: Figures = {"defect": defect, **await asyncio.to_thread(ours.recv)}
            return {**figures, "rss_growth_mb": rss, **own}
        finally:
            watcher.join(30)
            ctx.destroy(linger=0)
            daemon.stop(signal.SIGKILL)


# --- helpers for scenarios --------------------------------------------------------------------


def flood(endpoint: str, frames: list[bytes], count: int, read: bool = True) -> None:
    """One DEALER sends `frames` `count` times as fast as libzmq takes them (run in a thread)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(endpoint)
    try:
        for _ in range(count):
            sock.send_multipart(frames)
        if read:
            sock.setsockopt(zmq.RCVTIMEO, 30_000)
            with contextlib.suppress(zmq.Again):
                for _ in range(count):
                    sock.recv_multipart()
    finally:
        sock.close()
        ctx.term()


async def submit_many(client: EngineClient, count: int, max_tokens: int) -> dict[str, int]:
    codes: dict[str, int] = {}

    async def one(n: int) -> None:
        try:
            await client.submit([n % 50_000] * 64, max_tokens, timeout=120)
            codes["submitted"] = codes.get("submitted", 0) + 1
        except EngineError as error:
            codes[error.code] = codes.get(error.code, 0) + 1
        except TimeoutError:
            codes["timeout"] = codes.get("timeout", 0) + 1

    for start in range(0, count, 1000):
        await asyncio.gather(*(one(n) for n in range(start, min(start + 1000, count))))
    return codes


# --- the scenario registry, shared by abuse.py and abuse_clients.py -----------------------

ScenarioFn = Callable[[Run], Awaitable[Figures]]
# name -> (defect, what it plays, daemon flags, the scenario)
SCENARIOS: dict[str, tuple[int, str, list[str], ScenarioFn]] = {}
PACED = ["--speedup-ratio", "1", "--perf-model", "fixed", "--fixed-decode-ms-per-pass", "10"]


def scenario(
    name: str, defect: int, what: str, *daemon_args: str
) -> Callable[[ScenarioFn], ScenarioFn]:
    """Register `fn` as scenario `name` (issue 10, `defect`), on a daemon with `daemon_args`."""

    def register(fn: ScenarioFn) -> ScenarioFn:
        SCENARIOS[name] = (defect, what, list(daemon_args), fn)
        return fn

    return register
