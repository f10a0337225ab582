"""A ControlServer with real engine loops and a real ROUTER, inside the test's event loop.

For scenarios a daemon process cannot show at a small scale: the ROUTER's high-water mark is
the test's to choose (a slow reader is dropped after a few dozen messages instead of
100,000), and the server's per-client state can be inspected directly.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from engined.config.schema import CONTROL_UNREAD_BYTES
from engined.core.args import EngineArgs, EngineType, PerfModelKind, WorkerType
from engined.core.engine import Engine
from engined.model_clock import ModelClock
from engined.server.control.control_server import ControlServer
from engined.server.control.settings import RuntimeSettings
from engined.server.publish.fpm_publisher import NullFpmPublisher
from engined.server.publish.kv_publisher import NullKvPublisher
from engined.server.ranks.deadlines import Deadlines
from engined.server.ranks.engine_loop import EngineLoop
from engined.server.ranks.rank_build import Pacing
from engined.server.ranks.rank_sinks import Delivery, FpmSink, KvSink, Sleep
from engined.wire import control as wire
from engined.zmq_sockets import make_socket


def engine_args(**overrides: Any) -> EngineArgs:
    fields: dict[str, Any] = {
        "perf_model": PerfModelKind.FIXED,
        "fixed_prefill_ms_per_token": 0.0,
        "fixed_pass_overhead_ms": 0.0,
        "fixed_decode_ms_per_pass": 1.0,
        "block_size": 16,
        "num_gpu_blocks": 1024,
        "speedup_ratio": 0.0,
    }
    fields.update(overrides)
    return EngineArgs(**fields)


def welcome() -> wire.Welcome:
    return wire.Welcome(
        protocol=wire.PROTOCOL_VERSION,
        version="test",
        engine_type=EngineType.VLLM,
        worker_type=WorkerType.AGGREGATED,
        block_size=16,
        num_gpu_blocks=1024,
        dp_size=1,
        model_name="m",
        kv_events_endpoints=[],
        kv_replay_endpoints=[],
        fpm_endpoints=[],
    )


@dataclass
class Served:
    endpoint: str
    ctx: zmq.asyncio.Context
    control: ControlServer
    loops: list[EngineLoop]

    @property
    def loop(self) -> EngineLoop:
        """Rank 0's loop."""
        return self.loops[0]

    def dealer(self, *, rcvhwm: int = 1000, identity: bytes | None = None) -> zmq.asyncio.Socket:
        """A raw client; small kernel buffers, so a reader that stops is noticed soon."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.RCVBUF, 4096)
        if identity is not None:
            sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.connect(self.endpoint)
        return sock


def engine_loop(
    delivery: Delivery,
    *,
    rank: int = 0,
    kv: KvSink | None = None,
    fpm: FpmSink | None = None,
    clock: Callable[[], float] | None = None,
    sleep: Sleep | None = None,
    pacing: Pacing | None = None,
    **args: Any,
) -> EngineLoop:
    """One rank: a core of `engine_args(**args)` in an EngineLoop paced at its speedup ratio,
    publishing to `kv` and `fpm` (null publishers by default), on `clock` and `sleep` (the
    loop's defaults when None: the monotonic clock and the event loop's timers), sharing
    `pacing` (deadlines and a garbage collector) with other loops if given."""
    engine = Engine(engine_args(**args), dp_rank=rank, worker_id=rank)
    speedup_ratio = float(args.get("speedup_ratio", 0.0))
    return EngineLoop(
        engine,
        kv=NullKvPublisher() if kv is None else kv,
        fpm=NullFpmPublisher() if fpm is None else fpm,
        delivery=delivery,
        model_clock=ModelClock(speedup_ratio),
        clock=time.monotonic if clock is None else clock,
        sleep=sleep,
        deadlines=None if pacing is None else pacing.deadlines,
        collector=None if pacing is None else pacing.collector,
    )


@asynccontextmanager
async def serve(
    tmp_path: Path,
    *,
    ranks: int = 1,
    sndhwm: int = 100_000,
    rcvhwm: int = 100_000,
    sndbuf: int | None = 4096,
    kv: Callable[[int], KvSink] | None = None,
    fpm: Callable[[int], FpmSink] | None = None,
    clock: Callable[[], float] | None = None,
    sleep: Sleep | None = None,
    deadlines: Deadlines | None = None,
    unread_messages: int | None = None,
    unread_bytes: int = CONTROL_UNREAD_BYTES,
    **args: Any,
) -> AsyncIterator[Served]:
    """A ControlServer on a ROUTER at `ipc://{tmp_path}/control` with `ranks` engine loops of
    `engine_args(**args)` (see `engine_loop`; `kv` and `fpm` make a rank's sinks); the server
    reads `deadlines` (those of paced ranks) if given.

    The ROUTER's high-water marks are the test's, and its kernel send buffer is 4096 bytes by
    default (`sndbuf=None`: the system's), so a slow reader is dropped after a few dozen
    messages. A client is dropped once its pipe is full, unless `unread_messages` (pipe and
    backlog) allows more, as the daemon's does (`unread_bytes` then bounds the backlog).
    The server and the loops run as tasks of the test's event loop from the first
    await in the `async with` body: what the body does before it (adding pass observers,
    wrapping the server's methods) is in place for the first message and the first pass.
    """
    endpoint = f"ipc://{tmp_path}/control"
    ctx = zmq.asyncio.Context()
    sock = make_socket(
        ctx, zmq.ROUTER, endpoint, bind=True, sndhwm=sndhwm, rcvhwm=rcvhwm, router_mandatory=True
    )
    if sndbuf is not None:
        sock.setsockopt(zmq.SNDBUF, sndbuf)
    control = ControlServer(
        sock,
        welcome=welcome,
        settings=RuntimeSettings(vocab_size=None, excluded_token_ids=(), fpm_worker_id="w", fpm=[]),
        max_queued_requests=0,
        # As the daemon does (engined.server.daemon).
        handoff_timeout_s=engine_args(**args).handoff_session_timeout_ms / 1000.0,
        deadlines=deadlines,
        unread_messages=unread_messages,
        unread_bytes=unread_bytes,
    )
    loops = [
        engine_loop(
            control,
            rank=rank,
            kv=None if kv is None else kv(rank),
            fpm=None if fpm is None else fpm(rank),
            clock=clock,
            sleep=sleep,
            **args,
        )
        for rank in range(ranks)
    ]
    control.attach(loops)
    tasks = [asyncio.create_task(control.serve()), asyncio.create_task(control.expire_handoffs())]
    tasks += [asyncio.create_task(loop.run()) for loop in loops]
    try:
        yield Served(endpoint, ctx, control, loops)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sock.close(linger=0)
        ctx.destroy(linger=0)
