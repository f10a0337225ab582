"""One data-parallel rank's parts, built the same way wherever the rank runs.

The daemon builds its ranks here when they run in its own event loop, and so does a rank
worker process (`engined.server.ranks.rank_worker`) for the ranks it owns: the same core, loop and
publishers, bound to the same per-rank endpoints (`endpoint_for_rank`), so a client cannot
tell which process serves a rank.
"""

from __future__ import annotations

import gc
import os
from typing import NamedTuple

import zmq.asyncio

from engined.config import DaemonConfig, endpoint_for_rank
from engined.core.engine import Engine
from engined.model_clock import ModelClock
from engined.server.publish.fpm_publisher import FpmPublisher, NullFpmPublisher
from engined.server.publish.kv_publisher import AnyKvPublisher, KvPublisher, NullKvPublisher
from engined.server.ranks.collector import Collector, YoungGeneration
from engined.server.ranks.deadlines import Deadlines
from engined.server.ranks.engine_loop import EngineLoop
from engined.server.ranks.rank_sinks import Delivery
from engined.server.security.gatekeeper import Gatekeeper
from engined.zmq_sockets import SocketRegistry


class RankParts(NamedTuple):
    loop: EngineLoop
    kv: AnyKvPublisher
    fpm: FpmPublisher | NullFpmPublisher


def build_rank(
    ctx: zmq.asyncio.Context,
    registry: SocketRegistry,
    cfg: DaemonConfig,
    rank: int,
    *,
    worker_id: str,
    delivery: Delivery,
    batch_bytes: int,
    model_clock: ModelClock,
    pacing: Pacing | None = None,
    gate: Gatekeeper | None = None,
) -> RankParts:
    """Bind rank `rank`'s KV PUB (+ replay ROUTER) and FPM PUB, each unless turned off, and
    build its core and loop, paced by the process's one `model_clock`.

    Raises zmq.ZMQError or OSError when a socket cannot be bound (the caller reports a
    start-up failure).
    """
    engine = cfg.engine
    replay = endpoint_for_rank(cfg.kv_replay_endpoint, rank) if cfg.kv_replay_endpoint else None
    kv: AnyKvPublisher
    if cfg.kv_events_endpoint:
        kv = KvPublisher(
            ctx,
            registry,
            endpoint=endpoint_for_rank(cfg.kv_events_endpoint, rank),
            bind=not cfg.kv_events_connect,
            topic=cfg.kv_events_topic,
            fmt=cfg.kv_events_format,
            dp_rank=rank,
            replay_endpoint=replay,
            replay_buffer=cfg.kv_replay_buffer,
            buffer_bytes=cfg.kv_events_buffer_bytes,
            replay_client_bytes=cfg.kv_replay_client_bytes,
            batch_bytes=batch_bytes,
            gate=gate,
        )
    else:
        kv = NullKvPublisher()
    fpm: FpmPublisher | NullFpmPublisher
    if cfg.fpm_endpoint:
        fpm = FpmPublisher(
            ctx,
            registry,
            endpoint=endpoint_for_rank(cfg.fpm_endpoint, rank),
            worker_id=worker_id,
            dp_rank=rank,
            gate=gate,
        )
    else:
        fpm = NullFpmPublisher()
    core = Engine(
        engine,
        dp_rank=rank,
        worker_id=rank,
        python_hash_seed=os.environ.get("PYTHONHASHSEED"),
    )
    loop = EngineLoop(
        core,
        kv=kv,
        fpm=fpm,
        delivery=delivery,
        model_clock=model_clock,
        deadlines=None if pacing is None else pacing.deadlines,
        collector=None if pacing is None else pacing.collector,
    )
    return RankParts(loop, kv, fpm)


def freeze_startup_heap() -> None:
    """Move everything built at start-up out of the garbage collector's sight.

    As vLLM's engine core does after it is built (`gc.freeze`): the objects of start-up live
    as long as the process, and every full collection would otherwise walk them all again,
    pausing every rank of the loop for as long (the largest pass-start lateness seen).
    """
    gc.collect()
    gc.freeze()


def start_collection(
    model_clock: ModelClock, pacing: Pacing | None
) -> Collector | YoungGeneration | None:
    """Freeze the start-up heap, then collect as the process's ranks need; `close()` what it
    returns (if anything) to hand collection back to CPython.

    Paced ranks: `pacing`'s collector, in the gaps between passes. Unpaced: CPython's own
    collection, with a wider young generation (engined.server.ranks.collector). A paced daemon
    whose ranks run in worker processes keeps CPython's defaults for its own.
    """
    freeze_startup_heap()
    collection: Collector | YoungGeneration | None = None
    if pacing is not None:
        collection = pacing.collector
    elif not model_clock.paced:
        collection = YoungGeneration()
    if collection is not None:
        collection.start()
    return collection


class Pacing(NamedTuple):
    """What the paced ranks of one event loop share: their deadlines and the collector that
    runs in the gaps between them."""

    deadlines: Deadlines
    collector: Collector


def shared_pacing(model_clock: ModelClock) -> Pacing | None:
    """The `Pacing` of a process whose ranks are paced; None at speedup 0, where nothing
    waits for a deadline and CPython's own collection stays (engined.server.ranks.collector)."""
    if not model_clock.paced:
        return None
    deadlines = Deadlines()
    return Pacing(deadlines, Collector(deadlines))
