"""`engined dynamo-worker --worker-per-rank`: each rank of one daemon as a Dynamo worker.

A simulated cluster of N workers behind one frontend is one daemon with
`--data-parallel-size N` and one worker process, not N daemon/worker pairs: the ranks already
are independent engines (own core, KV events, FPM, load), so registering each as its own
Dynamo worker gives the router and planner N workers at the cost of one daemon's and one
worker's interpreter. Serving many daemons from one worker would still cost a daemon process
per simulated worker, which is what does not fit.

Every rank gets what `dynamo.vllm` gives a vLLM rank launched on its own (vLLM's external
load balancing, `--data-parallel-rank r`): its own `DistributedRuntime` (all on this event
loop and Dynamo's one tokio runtime, as `dynamo.mocker --num-workers` does), so its own
instance id; registration with the rank range `[r, r + 1)`, which is where the router files
the rank's KV events (they name rank r) and what it routes to; a `KvEventPublisher` and an
`FpmEventRelay` on the rank's PUB sockets; the rank's load; FPM stamped with its own worker
id (`set_fpm_worker_id` with `dp_rank`). Requests are pinned to the rank. With
`--enable-lora`, each rank's worker serves its own `load_lora`, `unload_lora` and
`list_loras`, as each dynamo.vllm worker does: an adapter loaded through one rank's instance
is that rank's (its card names the rank's range; its requests run there).
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import dataclass, field
from typing import Any

import structlog

from engined.client import EngineClient
from engined.dynamo.attach import attach, connect_daemon, set_fpm_worker_ids
from engined.dynamo.cards import register, runtime_config
from engined.dynamo.handler import Limits, RequestHandler
from engined.dynamo.model import read_model
from engined.dynamo.worker import (
    READY_LINE,
    follow,
    lora_service,
    rank_publishers,
    shut_down,
    warn_without_kv_events,
)
from engined.dynamo.worker_args import WorkerArgs
from engined.wire.control import Load, Welcome

log = structlog.get_logger(__name__)


@dataclass
class RankWorker:
    """One rank's Dynamo worker: its runtime, endpoint, handler and publishers."""

    rank: int
    runtime: Any
    endpoint: Any
    instance_id: int
    handler: RequestHandler
    metrics: Any = None
    publishers: list[Any] = field(default_factory=list)
    # (endpoint, handler) of `load_lora`, `unload_lora` and `list_loras` (`--enable-lora`).
    lora_endpoints: list[tuple[Any, Any]] = field(default_factory=list)


class Runtimes:
    """Every rank's runtime, shut down together (a signal, or the daemon gone)."""

    def __init__(self) -> None:
        self.all: list[Any] = []

    def shutdown(self) -> None:
        for runtime in self.all:
            runtime.shutdown()


async def serve_per_rank(args: WorkerArgs) -> int:
    """Register each rank of the daemon as a Dynamo worker and serve them until SIGTERM."""
    # As dynamo.mocker: the worker never tokenizes, so no compute threads.
    os.environ.setdefault("DYN_COMPUTE_THREADS", "0")
    client = await connect_daemon(args)
    workers: list[RankWorker] = []
    runtimes = Runtimes()
    try:
        welcome, context = await attach(client, args)
        warn_without_kv_events(welcome)
        name = args.served_model_name or welcome.model_name
        vocab_size = read_model(args.model_path).vocab_size
        limits = Limits(args.control_endpoint, context, welcome.speedup_ratio or 0.0, vocab_size)
        for rank in range(welcome.dp_size):
            workers.append(await _start_rank(args, client, welcome, limits, name, rank, runtimes))

        def on_load(load: Load) -> None:
            if load.dp_rank < len(workers):
                workers[load.dp_rank].metrics.publish(
                    load.dp_rank, kv_used_blocks=load.active_blocks
                )

        await client.watch_load(on_load)
        for worker in workers:
            config = runtime_config(welcome, context, worker.rank)
            await register(args, worker.endpoint, name, welcome, config)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runtimes.shutdown)

        def republish(returned: Welcome) -> None:
            for worker in workers:
                shut_down(worker.publishers)
                worker.publishers = rank_publishers(worker.endpoint, returned, worker.rank)

        fpm_ids = [(w.rank, w.instance_id) for w in workers]
        follower, ended = follow(
            client, args, [w.endpoint for w in workers], welcome, fpm_ids, republish, on_load
        )
        ended.add_done_callback(lambda _: runtimes.shutdown())
        for worker in workers:
            worker.handler.gate = follower
        following = asyncio.ensure_future(follower.run())
        log.info(
            READY_LINE,
            model=name,
            endpoint=args.endpoint_path,
            worker_ids=[w.instance_id for w in workers],
            mode=args.disaggregation_mode.value,
            dp_size=welcome.dp_size,
            block_size=welcome.block_size,
            context_length=context,
        )
        try:
            labels = [("model", name)]
            await asyncio.gather(
                *(
                    w.endpoint.serve_endpoint(
                        w.handler.generate, graceful_shutdown=True, metrics_labels=labels
                    )
                    for w in workers
                ),
                *(
                    lora.serve_endpoint(serve, metrics_labels=labels)
                    for w in workers
                    for lora, serve in w.lora_endpoints
                ),
            )
        finally:
            following.cancel()
        log.info(
            "engined dynamo-worker stopped", in_flight=sum(w.handler.in_flight for w in workers)
        )
        return 1 if ended.done() else 0
    finally:
        for worker in workers:
            shut_down(worker.publishers)
            await worker.handler.close()
        await client.close()


async def _start_rank(
    args: WorkerArgs,
    client: EngineClient,
    welcome: Welcome,
    limits: Limits,
    name: str,
    rank: int,
    runtimes: Runtimes,
) -> RankWorker:
    from dynamo.llm import WorkerMetricsPublisher
    from dynamo.runtime import DistributedRuntime

    runtime = DistributedRuntime(
        asyncio.get_running_loop(),
        args.discovery_backend,
        args.request_plane,
        event_plane=args.event_plane,
    )
    runtimes.all.append(runtime)
    endpoint = runtime.endpoint(args.endpoint_path)
    instance_id = endpoint.connection_id()
    await set_fpm_worker_ids(client, args, welcome, [(rank, instance_id)])
    adapters, lora_endpoints = lora_service(
        args, runtime, endpoint, client, welcome, limits.context_length, name, rank
    )
    handler = RequestHandler(
        client,
        args.disaggregation_mode,
        limits,
        connect=EngineClient.connect,
        rank=rank,
        adapters=adapters,
    )
    worker = RankWorker(rank, runtime, endpoint, instance_id, handler)
    worker.lora_endpoints = lora_endpoints
    worker.publishers = rank_publishers(endpoint, welcome, rank)
    worker.metrics = WorkerMetricsPublisher()
    await worker.metrics.create_endpoint(endpoint)
    return worker
