"""A ControlServer with real engine loops and a real ROUTER, inside the test's event loop.

For scenarios a daemon process cannot show at a small scale: the ROUTER's high-water mark is
the test's to choose (a slow reader is dropped after a few dozen messages instead of
100,000), and the server's per-client state can be inspected directly.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
import zmq.asyncio

from engined.core.args import EngineArgs, PerfModelKind
from engined.core.engine import Engine
from engined.server.control import ControlServer
from engined.server.engine_loop import EngineLoop
from engined.server.fpm_publisher import NullFpmPublisher
from engined.server.kv_publisher import NullKvPublisher
from engined.server.settings import RuntimeSettings
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
        engine_type="vllm",
        worker_type="aggregated",
        block_size=16,
        num_gpu_blocks=1024,
        dp_size=1,
        model_name="m",
        kv_events_endpoints=[],
        kv_replay_endpoints=[],
        fpm_endpoints=[],
    )


class _Delivery:
    def __init__(self) -> None:
        self.control: ControlServer | None = None

    def deliver_outputs(self, rank: int, outputs: list[Any]) -> None:
        assert self.control is not None
        self.control.deliver_outputs(rank, outputs)

    def deliver_lifecycle(self, rank: int, events: list[Any]) -> None:
        assert self.control is not None
        self.control.deliver_lifecycle(rank, events)


@dataclass
class Served:
    endpoint: str
    ctx: zmq.asyncio.Context
    control: ControlServer
    loop: EngineLoop

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


@asynccontextmanager
async def serve(tmp_path: Path, *, sndhwm: int = 100_000, **args: Any) -> AsyncIterator[Served]:
    endpoint = f"ipc://{tmp_path}/control"
    ctx = zmq.asyncio.Context()
    sock = make_socket(
        ctx, zmq.ROUTER, endpoint, bind=True, sndhwm=sndhwm, rcvhwm=100_000, router_mandatory=True
    )
    sock.setsockopt(zmq.SNDBUF, 4096)
    delivery = _Delivery()
    loop = EngineLoop(
        Engine(engine_args(**args)),
        kv=NullKvPublisher(),
        fpm=NullFpmPublisher(),
        delivery=delivery,
        speedup_ratio=float(args.get("speedup_ratio", 0.0)),
    )
    control = ControlServer(
        sock,
        [loop],
        welcome=welcome,
        settings=RuntimeSettings(vocab_size=None, excluded_token_ids=(), fpm_worker_id="w", fpm=[]),
        max_queued_requests=0,
    )
    delivery.control = control
    tasks = [asyncio.create_task(control.serve()), asyncio.create_task(loop.run())]
    try:
        yield Served(endpoint, ctx, control, loop)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        sock.close(linger=0)
        ctx.destroy(linger=0)
