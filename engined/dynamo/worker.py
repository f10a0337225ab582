"""Start-up, registration and shutdown of the Dynamo worker (`engined dynamo-worker`).

What `dynamo.vllm` does for a vLLM engine, done for an engined daemon: read the engine's
real limits (here the daemon's `welcome`), register the model card with them, point one
`KvEventPublisher` and one `FpmEventRelay` per data-parallel rank at the daemon's PUB
sockets, publish each rank's used blocks for the router, and serve `generate` until SIGTERM.
With `--enable-lora` it serves dynamo.vllm's LoRA endpoints beside `generate` and registers
each loaded adapter's card (engined/dynamo/lora.py, engined/dynamo/cards.py). With
`--worker-per-rank`, engined/dynamo/cluster.py registers each rank as a worker instead.
Every start-up failure is a `SetupError` printed as one line, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Final

import structlog

from engined import event_loop
from engined.client import EngineClient
from engined.dynamo.attach import (
    as_operator,
    attach,
    connect_daemon,
    set_fpm_worker_ids,
    set_vocabulary,
)
from engined.dynamo.cards import (
    adapter_runtime_config,
    register,
    register_adapter,
    runtime_config,
    unregister_adapter,
)
from engined.dynamo.cards import (
    # Re-exported: its rule is the worker's (tests/dynamo/test_model.py checks it here).
    publishes_kv_events as publishes_kv_events,
)
from engined.dynamo.handler import Limits, RequestHandler
from engined.dynamo.lora import BASE_MODEL_ONLY, BaseModelOnly, LoraAdapters, dynamo_naming
from engined.dynamo.model import SetupError, read_model
from engined.dynamo.recovery import DaemonFollower
from engined.dynamo.startup import dynamo_step, runtime_failure
from engined.dynamo.worker_args import WorkerArgs, parse_args
from engined.logs import configure_logging
from engined.wire.control import Load, Welcome

log = structlog.get_logger(__name__)

READY_LINE: Final = "engined dynamo-worker ready"
INSTALL_HINT: Final = (
    "engined dynamo-worker needs NVIDIA Dynamo's runtime: pip install 'engined[dynamo]' "
    "(ai-dynamo-runtime 1.6.1), or `python -m dynamo.frontend` users: pip install "
    "ai-dynamo-runtime==1.6.1 beside engined"
)


Serve = Callable[[WorkerArgs], Coroutine[Any, Any, int]]


def main(argv: Sequence[str] | None = None, *, serve_per_rank: Serve | None = None) -> int:
    """Run the worker; exit status 0 after SIGTERM, 1 on a start-up failure, 2 on usage.

    `serve_per_rank` serves `--worker-per-rank` (engined.dynamo.cluster's, which builds on
    this module, so the entry points hand it in).
    """
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging("auto", "info")
    try:
        import dynamo._core  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    try:
        if args.worker_per_rank and serve_per_rank is None:
            raise SetupError("--worker-per-rank: this entry point does not serve it")
        return _run(serve_per_rank if serve_per_rank and args.worker_per_rank else serve, args)
    except SetupError as exc:
        print(f"engined dynamo-worker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _run(server: Serve, args: WorkerArgs) -> int:
    return event_loop.run(server(args))


def _publishers(endpoint: Any, welcome: Welcome) -> list[Any]:
    """One KV event publisher and one FPM relay per rank, subscribed to the daemon's PUBs."""
    warn_without_kv_events(welcome)
    return [p for rank in range(welcome.dp_size) for p in rank_publishers(endpoint, welcome, rank)]


def warn_without_kv_events(welcome: Welcome) -> None:
    if welcome.enable_prefix_caching and not welcome.kv_events_endpoints:
        log.warning(
            "the engined daemon publishes no KV events (its kv_events_endpoint is off); "
            "registering without them, so a KV router cannot see this worker's cache"
        )


def rank_publishers(endpoint: Any, welcome: Welcome, rank: int) -> list[Any]:
    """Rank's KV event publisher and FPM relay on `endpoint` (those the daemon publishes).

    The publisher attributes each batch to the rank the batch names (vLLM's
    `data_parallel_rank`, the daemon's rank), not to its own `dp_rank`, so a Dynamo worker
    serving one rank registers that rank's number as its first (`data_parallel_start_rank`).
    """
    from dynamo.llm import FpmEventRelay, KvEventPublisher

    made: list[Any] = []
    if publishes_kv_events(welcome) and rank < len(welcome.kv_events_endpoints):
        made.append(
            KvEventPublisher(
                endpoint=endpoint,
                kv_block_size=welcome.block_size,
                dp_rank=rank,
                enable_local_indexer=True,
                zmq_endpoint=welcome.kv_events_endpoints[rank],
                zmq_topic=welcome.kv_events_topic or "",
            )
        )
    if rank < len(welcome.fpm_endpoints):
        made.append(FpmEventRelay(endpoint=endpoint, zmq_endpoint=welcome.fpm_endpoints[rank]))
    return made


async def serve(args: WorkerArgs) -> int:
    from dynamo.llm import WorkerMetricsPublisher
    from dynamo.runtime import DistributedRuntime

    client = await connect_daemon(args)
    publishers: list[Any] = []
    handler: RequestHandler | None = None
    try:
        welcome, context = await attach(client, args)
        loop = asyncio.get_running_loop()
        try:
            runtime = DistributedRuntime(
                loop, args.discovery_backend, args.request_plane, event_plane=args.event_plane
            )
        except Exception as error:
            raise runtime_failure(error, args, os.environ) from None
        with dynamo_step(f"Dynamo refused the endpoint {args.endpoint_path}"):
            endpoint = runtime.endpoint(args.endpoint_path)
            worker_id = endpoint.connection_id()
        fpm_ids: list[tuple[int | None, int]] = [(None, worker_id)]
        await set_fpm_worker_ids(client, args, welcome, fpm_ids)
        name = args.served_model_name or welcome.model_name
        adapters, lora_endpoints = lora_service(
            args, runtime, endpoint, client, welcome, context, name
        )
        handler = RequestHandler(
            client,
            args.disaggregation_mode,
            Limits(
                args.control_endpoint,
                context,
                welcome.speedup_ratio or 0.0,
                read_model(args.model_path).vocab_size,
            ),
            connect=EngineClient.connect,
            adapters=adapters,
        )
        with dynamo_step("Dynamo refused the KV event, FPM or load publishers"):
            publishers = _publishers(endpoint, welcome)
            metrics = WorkerMetricsPublisher()
            await metrics.create_endpoint(endpoint)

        def on_load(load: Load) -> None:
            metrics.publish(load.dp_rank, kv_used_blocks=load.active_blocks)

        await client.watch_load(on_load)
        mode = args.disaggregation_mode
        await register(args, endpoint, name, welcome, runtime_config(welcome, context))
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runtime.shutdown)

        def republish(returned: Welcome) -> None:
            shut_down(publishers)
            publishers[:] = _publishers(endpoint, returned)

        follower, ended = follow(client, args, [endpoint], welcome, fpm_ids, republish, on_load)
        ended.add_done_callback(lambda _: runtime.shutdown())
        handler.gate = follower
        following = asyncio.ensure_future(follower.run())
        log.info(
            READY_LINE,
            model=name,
            endpoint=args.endpoint_path,
            worker_id=worker_id,
            mode=mode.value,
            dp_size=welcome.dp_size,
            block_size=welcome.block_size,
            context_length=context,
        )
        try:
            with dynamo_step(f"Dynamo stopped serving {args.endpoint_path}"):
                labels = [("model", name)]
                await asyncio.gather(
                    endpoint.serve_endpoint(
                        handler.generate, graceful_shutdown=True, metrics_labels=labels
                    ),
                    *(
                        lora.serve_endpoint(serve, metrics_labels=labels)
                        for lora, serve in lora_endpoints
                    ),
                )
        finally:
            following.cancel()
        log.info("engined dynamo-worker stopped", in_flight=handler.in_flight)
        return 1 if ended.done() else 0
    finally:
        shut_down(publishers)
        if handler is not None:
            await handler.close()
        await client.close()


def lora_service(
    args: WorkerArgs,
    runtime: Any,
    endpoint: Any,
    client: EngineClient,
    welcome: Welcome,
    context: int,
    name: str,
    rank: int | None = None,
) -> tuple[LoraAdapters | BaseModelOnly, list[tuple[Any, Callable[..., Any]]]]:
    """The worker's adapters, and the endpoints that load, unload and list them: with
    `--enable-lora` only, as dynamo.vllm serves `load_lora`, `unload_lora` and `list_loras`
    beside `generate` (dynamo/vllm/worker_factory.py), each adapter a card on `generate`.
    With `rank` (`--worker-per-rank`), the adapters of that rank's worker alone, as each
    dynamo.vllm worker keeps its own: their cards name the rank, and a hot swap clears that
    rank's prefix cache only."""
    if not args.enable_lora:
        return BASE_MODEL_ONLY, []

    async def publish(lora_name: str, lora_id: int) -> None:
        config = adapter_runtime_config(welcome, context, rank)
        await register_adapter(args, endpoint, welcome, config, lora_name, lora_id)

    async def reset_prefix_cache() -> None:
        await as_operator(
            client,
            welcome,
            args.control_endpoint,
            "a prefix cache reset",
            lambda c: c.reset_prefix_cache(rank),
        )

    adapters = LoraAdapters(
        (name, str(args.model_path)),
        publish=publish,
        withdraw=lambda lora_name: unregister_adapter(endpoint, lora_name),
        reset_prefix_cache=reset_prefix_cache,
        naming=dynamo_naming(),
        env=os.environ,
    )
    prefix = f"{args.namespace}.{args.component}"
    with dynamo_step(f"Dynamo refused the LoRA endpoints of {prefix}"):
        served = [
            (runtime.endpoint(f"{prefix}.load_lora"), adapters.load_lora),
            (runtime.endpoint(f"{prefix}.unload_lora"), adapters.unload_lora),
            (runtime.endpoint(f"{prefix}.list_loras"), adapters.list_loras),
        ]
    return adapters, served


def follow(
    client: EngineClient,
    args: WorkerArgs,
    endpoints: Sequence[Any],
    welcome: Welcome,
    fpm_ids: Sequence[tuple[int | None, int]],
    republish: Callable[[Welcome], None],
    on_load: Callable[[Load], None],
) -> tuple[DaemonFollower, asyncio.Future[str]]:
    """The follower of the worker's daemon (one, however many Dynamo workers serve it), and
    a future done, with the reason, when the worker must end: its daemon came back with
    another shape than the one it registered."""
    ended: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def setup(returned: Welcome) -> None:
        await set_vocabulary(client, args, returned)
        await set_fpm_worker_ids(client, args, returned, fpm_ids)

    def end(reason: str) -> None:
        log.error(reason)
        if not ended.done():
            ended.set_result(reason)

    follower = DaemonFollower(
        client,
        endpoints,
        welcome,
        setup=setup,
        republish=republish,
        watch_load=lambda: client.watch_load(on_load),
        end=end,
    )
    return follower, ended


def shut_down(publishers: list[Any]) -> None:
    """Stop KV event publishers and FPM relays (at exit, or replaced on a daemon restart)."""
    for publisher in publishers:
        with contextlib.suppress(Exception):
            publisher.shutdown()
