"""`engined fpm`: watch the forward-pass metrics a planner would read.

Each message is one executed pass (or an idle heartbeat every second): what was scheduled
(prefill and decode requests, tokens, KV tokens), what waits in the queue, and the modeled
pass time. On a terminal the view is a live table with a column per rank, redrawn at most
ten times a second (a busy daemon sends thousands of messages a second); elsewhere each
message is one line (JSON with `--json`, in Dynamo's schema, so a recorded stream can be
replayed into planner tests).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import msgspec
import zmq
import zmq.asyncio
from rich import box
from rich.live import Live
from rich.table import Table

from engined.tools.common import (
    EXIT_OK,
    Output,
    ToolError,
    control_client,
    discover,
    pick_rank,
    zmq_context,
)
from engined.tools.option_values import DEFAULT_TIMEOUT
from engined.wire.fpm_schema import ForwardPassMetrics, decode_fpm
from engined.wire.protocol_errors import WireError
from engined.zmq_sockets import make_socket

_SUB_HWM: Final = 100_000
_REDRAW_S: Final = 0.1


@dataclass(frozen=True, slots=True)
class FpmOptions:
    control_endpoint: str
    fpm_endpoint: str | None = None
    rank: int = 0
    all_ranks: bool = False
    count: int | None = None
    duration: float | None = None
    timeout: float = DEFAULT_TIMEOUT


async def fpm(options: FpmOptions, out: Output) -> int:
    """Subscribe to the chosen ranks' FPM PUBs and show each message until --count/--duration."""
    async with zmq_context() as ctx:
        endpoints = await _endpoints(ctx, options)
        # One SUB connected to every chosen rank: each payload names its rank.
        sub = make_socket(ctx, zmq.SUB, endpoints[0], bind=False, rcvhwm=_SUB_HWM, linger=0)
        try:
            for endpoint in endpoints[1:]:
                sub.connect(endpoint)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            view = _LiveView() if out.console is not None else None
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(options.duration):
                    if view is not None:
                        with Live(view.table(), console=out.console, auto_refresh=False) as live:
                            try:
                                await _read(sub, options, out, view, live)
                            finally:
                                live.update(view.table(), refresh=True)
                    else:
                        await _read(sub, options, out, None, None)
        finally:
            sub.close(linger=0)
    return EXIT_OK


async def _endpoints(ctx: zmq.asyncio.Context, options: FpmOptions) -> list[str]:
    """`--fpm-endpoint`, else the welcome's FPM endpoint of --rank (or of every rank)."""
    if options.fpm_endpoint is not None:
        return [options.fpm_endpoint]
    async with control_client(ctx, options.control_endpoint) as client:
        welcome = await discover(client, options.control_endpoint, options.timeout)
    if not welcome.fpm_endpoints:
        raise ToolError("the daemon publishes no forward-pass metrics (its fpm_endpoint is off)")
    if options.all_ranks:
        return list(welcome.fpm_endpoints)
    return [pick_rank(welcome.fpm_endpoints, options.rank, "forward-pass metrics")]


async def _read(
    sub: zmq.asyncio.Socket,
    options: FpmOptions,
    out: Output,
    view: _LiveView | None,
    live: Live | None,
) -> None:
    shown = 0
    drawn = 0.0
    while options.count is None or shown < options.count:
        frames = await sub.recv_multipart()
        shown += 1
        if len(frames) != 3:
            _problem(out, f"malformed message with {len(frames)} frame(s)")
            continue
        try:
            metrics = decode_fpm(frames[2])
        except WireError as error:
            _problem(out, f"undecodable payload: {error.message}")
            continue
        if view is not None and live is not None:
            view.add(metrics)
            now = time.monotonic()
            if now - drawn >= _REDRAW_S:
                live.update(view.table(), refresh=True)
                drawn = now
        elif out.json:
            out.record(metrics_record(metrics))
        else:
            out.line(metrics_text(metrics))


def _problem(out: Output, message: str) -> None:
    if out.json:
        out.record({"malformed": {"reason": message}})
    else:
        out.warning(message)


def metrics_record(metrics: ForwardPassMetrics) -> dict[str, Any]:
    """Dynamo's ForwardPassMetrics v1 as a JSON object (its own keys, nested)."""
    record: dict[str, Any] = msgspec.to_builtins(metrics)
    return record


def metrics_text(m: ForwardPassMetrics) -> str:
    """One line per snapshot for logs and pipes."""
    s, q = m.scheduled_requests, m.queued_requests
    heartbeat = " (heartbeat)" if _is_heartbeat(m) else ""
    return (
        f"rank {m.dp_rank} #{m.counter_id} wall {m.wall_time * 1000.0:.3f} ms  "
        f"prefill {s.num_prefill_requests} req {s.sum_prefill_tokens} tok "
        f"(kv {s.sum_prefill_kv_tokens})  decode {s.num_decode_requests} req "
        f"kv {s.sum_decode_kv_tokens}  queued prefill {q.num_prefill_requests} req "
        f"{q.sum_prefill_tokens} tok, decode {q.num_decode_requests} req "
        f"kv {q.sum_decode_kv_tokens}{heartbeat}"
    )


def _is_heartbeat(m: ForwardPassMetrics) -> bool:
    s, q = m.scheduled_requests, m.queued_requests
    return (
        m.wall_time == 0.0
        and s.num_prefill_requests == 0
        and s.num_decode_requests == 0
        and q.num_prefill_requests == 0
        and q.num_decode_requests == 0
    )


class _LiveView:
    """The latest snapshot per rank, and passes per second since the view started."""

    def __init__(self) -> None:
        self._latest: dict[int, ForwardPassMetrics] = {}
        self._passes: dict[int, int] = {}
        self._start = time.monotonic()

    def add(self, metrics: ForwardPassMetrics) -> None:
        self._latest[metrics.dp_rank] = metrics
        if not _is_heartbeat(metrics):
            self._passes[metrics.dp_rank] = self._passes.get(metrics.dp_rank, 0) + 1

    def table(self) -> Table:
        """Metrics down, ranks across: thirteen fields fit a terminal for a handful of ranks."""
        table = Table(title="forward-pass metrics", title_justify="left", box=box.SIMPLE_HEAD)
        table.add_column("")
        ranks = sorted(self._latest)
        for rank in ranks:
            table.add_column(f"rank {rank}", justify="right")
        elapsed = max(time.monotonic() - self._start, 1e-9)
        rows: list[tuple[str, Callable[[int, ForwardPassMetrics], str]]] = [
            ("counter_id", lambda r, m: str(m.counter_id)),
            ("wall_time ms", lambda r, m: f"{m.wall_time * 1000.0:.3f}"),
            ("passes/s", lambda r, m: f"{self._passes.get(r, 0) / elapsed:.1f}"),
            ("prefill requests", lambda r, m: str(m.scheduled_requests.num_prefill_requests)),
            ("prefill tokens", lambda r, m: str(m.scheduled_requests.sum_prefill_tokens)),
            ("prefill kv tokens", lambda r, m: str(m.scheduled_requests.sum_prefill_kv_tokens)),
            ("decode requests", lambda r, m: str(m.scheduled_requests.num_decode_requests)),
            ("decode kv tokens", lambda r, m: str(m.scheduled_requests.sum_decode_kv_tokens)),
            ("queued prefill", lambda r, m: str(m.queued_requests.num_prefill_requests)),
            ("queued prefill tokens", lambda r, m: str(m.queued_requests.sum_prefill_tokens)),
            ("queued decode", lambda r, m: str(m.queued_requests.num_decode_requests)),
            ("queued decode kv", lambda r, m: str(m.queued_requests.sum_decode_kv_tokens)),
        ]
        for name, cell in rows:
            table.add_row(name, *(cell(rank, self._latest[rank]) for rank in ranks))
        if not ranks:
            table.caption = "waiting for the first message..."
        return table
