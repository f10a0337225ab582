"""Start-up, registration and shutdown of the Dynamo worker (`engined dynamo-worker`).

What `dynamo.vllm` does for a vLLM engine, done for an engined daemon: read the engine's
real limits (here the daemon's `welcome`), register the model card with them, point one
`KvEventPublisher` and one `FpmEventRelay` per data-parallel rank at the daemon's PUB
sockets, publish each rank's used blocks for the router, and serve `generate` until SIGTERM.
Every start-up failure is a `SetupError` printed as one line, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Final

import structlog

from engined.client import EngineClient, EngineError
from engined.dynamo.args import DisaggregationMode, WorkerArgs, parse_args
from engined.dynamo.handler import Chunk, Context, Limits, RequestHandler, daemon_gone
from engined.dynamo.model import (
    SetupError,
    check_role,
    context_length,
    read_model,
    reconcile_vocabulary,
)
from engined.dynamo.recovery import DaemonFollower
from engined.logs import configure_logging
from engined.model_dir import ModelInfo
from engined.wire.control import Load, Welcome

log = structlog.get_logger(__name__)

READY_LINE: Final = "engined dynamo-worker ready"
INSTALL_HINT: Final = (
    "engined dynamo-worker needs NVIDIA Dynamo's runtime: pip install 'engined[dynamo]' "
    "(ai-dynamo-runtime 1.6.1), or `python -m dynamo.frontend` users: pip install "
    "ai-dynamo-runtime==1.6.1 beside engined"
)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the worker; exit status 0 after SIGTERM, 1 on a start-up failure, 2 on usage."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    configure_logging("auto", "info")
    try:
        import dynamo._core  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    try:
        return _run(args)
    except SetupError as exc:
        print(f"engined dynamo-worker: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _run(args: WorkerArgs) -> int:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - ai-dynamo-runtime depends on uvloop
        return asyncio.run(serve(args))
    status: int = uvloop.run(serve(args))
    return status


async def _hello(client: EngineClient, args: WorkerArgs) -> Welcome:
    try:
        return await client.hello(timeout=args.connect_timeout)
    except TimeoutError:
        raise SetupError(
            f"no engined daemon answered at {args.control_endpoint} within "
            f"{args.connect_timeout:g} s: start one with `engined serve --control-endpoint "
            f"{args.control_endpoint}` (or pass --control-endpoint)"
        ) from None


async def as_operator(
    client: EngineClient,
    welcome: Welcome,
    control_endpoint: str,
    what: str,
    command: Callable[[EngineClient], Awaitable[object]],
) -> None:
    """Send an engine-wide command where the daemon takes it: its operator endpoint, which
    admits this worker as operator when it runs as the daemon's user (protocol §1.5), else
    the control connection (an ipc one, or one with an operator CURVE key).

    Raises:
        SetupError: the daemon refused it (`what` says what), or its operator endpoint did
            not answer (another user's worker cannot connect there).
    """
    endpoint = welcome.operator_endpoint
    try:
        if endpoint is None or endpoint == control_endpoint:
            await command(client)
            return
        async with await EngineClient.connect(endpoint) as operator:
            await command(operator)
    except EngineError as exc:
        raise SetupError(f"the daemon refused {what}: {exc.message}") from None
    except TimeoutError:
        raise SetupError(
            f"the daemon's operator endpoint {endpoint} did not answer for {what}: run the "
            "worker as the daemon's user (docs/security.md §2)"
        ) from None


async def _attach(client: EngineClient, args: WorkerArgs) -> tuple[Welcome, int]:
    """Check the daemon against the model and adapt its vocabulary; (welcome, context)."""
    model = read_model(args.model_path)
    welcome = await _hello(client, args)
    check_role(args.disaggregation_mode.value, welcome)
    if welcome.max_model_len is None or welcome.max_num_seqs is None:
        raise SetupError(
            f"the daemon at {args.control_endpoint} (engined {welcome.version}) is too old "
            "for dynamo-worker: upgrade it"
        )
    await _set_vocabulary(client, args, model, welcome)
    return welcome, context_length(model, welcome.max_model_len)


async def _set_vocabulary(
    client: EngineClient, args: WorkerArgs, model: ModelInfo, welcome: Welcome
) -> None:
    """The model's vocabulary on the daemon, at start-up and on every restart of it."""
    vocabulary = reconcile_vocabulary(model, welcome)
    if vocabulary.apply:
        await as_operator(
            client,
            welcome,
            args.control_endpoint,
            "the model's vocabulary",
            lambda c: c.set_vocabulary(vocabulary.vocab_size, vocabulary.excluded_token_ids),
        )
        log.info(
            "vocabulary set on the daemon",
            vocab_size=vocabulary.vocab_size,
            excluded_token_ids=list(vocabulary.excluded_token_ids),
        )


async def _set_fpm_worker_id(
    client: EngineClient, args: WorkerArgs, welcome: Welcome, endpoint: Any
) -> None:
    """The planner joins FPM with this worker by the id dynamo.vllm stamps: the endpoint's."""
    worker_id = str(endpoint.connection_id())
    await as_operator(
        client,
        welcome,
        args.control_endpoint,
        "the FPM worker id",
        lambda c: c.set_fpm_worker_id(worker_id),
    )


def _runtime_config(welcome: Welcome, context: int) -> Any:
    from dynamo.llm import ModelRuntimeConfig

    config = ModelRuntimeConfig()
    config.context_length = context
    config.total_kv_blocks = welcome.num_gpu_blocks  # per rank, as Dynamo wants it
    config.max_num_seqs = welcome.max_num_seqs
    config.max_num_batched_tokens = welcome.max_num_batched_tokens
    config.data_parallel_start_rank = 0
    config.data_parallel_size = welcome.dp_size
    config.enable_local_indexer = False
    config.kv_event_publishing_enabled = publishes_kv_events(welcome)
    # The frontend refuses prompts (and prompt + max_tokens) past the context up front, as
    # dynamo.vllm asks it to (`dynamo/vllm/capacity.py`).
    budget = {
        "combined_limit": context,
        "reject_prompt_overflow": True,
        "reject_total_overflow": True,
    }
    config.set_engine_specific("token_budget", json.dumps(budget))
    return config


def publishes_kv_events(welcome: Welcome) -> bool:
    """Whether the daemon's ranks publish KV events a router can index.

    A daemon with `kv_events_endpoint = ""` (vLLM's `enable_kv_cache_events: false`) is
    registered without them, as dynamo.vllm registers such an engine: Dynamo's KV router then
    warns that the worker's publisher is disabled, or, with `--no-kv-events`, predicts cache
    state from its own routing decisions.
    """
    return bool(welcome.enable_prefix_caching and welcome.kv_events_endpoints)


def _publishers(endpoint: Any, welcome: Welcome) -> list[Any]:
    """One KV event publisher and one FPM relay per rank, subscribed to the daemon's PUBs."""
    from dynamo.llm import FpmEventRelay, KvEventPublisher

    made: list[Any] = []
    if welcome.enable_prefix_caching and not welcome.kv_events_endpoints:
        log.warning(
            "the engined daemon publishes no KV events (its kv_events_endpoint is off); "
            "registering without them, so a KV router cannot see this worker's cache"
        )
    if publishes_kv_events(welcome):
        for rank, kv_endpoint in enumerate(welcome.kv_events_endpoints):
            made.append(
                KvEventPublisher(
                    endpoint=endpoint,
                    kv_block_size=welcome.block_size,
                    dp_rank=rank,
                    zmq_endpoint=kv_endpoint,
                    zmq_topic=welcome.kv_events_topic or "",
                )
            )
    for fpm_endpoint in welcome.fpm_endpoints:
        made.append(FpmEventRelay(endpoint=endpoint, zmq_endpoint=fpm_endpoint))
    return made


async def serve(args: WorkerArgs) -> int:
    from dynamo.llm import ModelInput, ModelType, WorkerMetricsPublisher, WorkerType, register_model
    from dynamo.runtime import DistributedRuntime

    try:
        client = await EngineClient.connect(args.control_endpoint, liveness_s=args.daemon_liveness)
    except ValueError as error:  # the CURVE key files the environment names
        raise SetupError(str(error)) from None
    publishers: list[Any] = []
    handler: RequestHandler | None = None
    try:
        welcome, context = await _attach(client, args)
        loop = asyncio.get_running_loop()
        runtime = DistributedRuntime(
            loop, args.discovery_backend, args.request_plane, event_plane=args.event_plane
        )
        endpoint = runtime.endpoint(args.endpoint_path)
        worker_id = endpoint.connection_id()
        await _set_fpm_worker_id(client, args, welcome, endpoint)
        name = args.served_model_name or welcome.model_name
        handler = RequestHandler(
            client,
            args.disaggregation_mode,
            Limits(args.control_endpoint, context, welcome.speedup_ratio or 0.0),
            connect=EngineClient.connect,
        )
        publishers = _publishers(endpoint, welcome)
        metrics = WorkerMetricsPublisher()
        await metrics.create_endpoint(endpoint)

        def on_load(load: Load) -> None:
            metrics.publish(load.dp_rank, kv_used_blocks=load.active_blocks)

        await client.watch_load(on_load)
        mode = args.disaggregation_mode
        if mode is DisaggregationMode.PREFILL:
            # ModelType.Prefill is the legacy marker older frontends detect prefill by.
            model_type, worker_type = ModelType.Prefill, WorkerType.Prefill
            needs = [[WorkerType.Decode]]
        elif mode is DisaggregationMode.DECODE:
            model_type = ModelType.Chat | ModelType.Completions
            worker_type, needs = WorkerType.Decode, [[WorkerType.Prefill]]
        else:
            model_type = ModelType.Chat | ModelType.Completions
            worker_type, needs = WorkerType.Aggregated, []
        try:
            await register_model(
                ModelInput.Tokens,
                model_type,
                endpoint,
                str(args.model_path),
                name,
                worker_type=worker_type,
                needs=needs,
                kv_cache_block_size=welcome.block_size,
                runtime_config=_runtime_config(welcome, context),
            )
        except (ValueError, RuntimeError, OSError) as exc:
            raise SetupError(f"Dynamo refused to register the model: {exc}") from None
        ended: list[str] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, runtime.shutdown)

        async def setup(returned: Welcome) -> None:
            await _set_vocabulary(client, args, read_model(args.model_path), returned)
            await _set_fpm_worker_id(client, args, returned, endpoint)

        def republish(returned: Welcome) -> None:
            for publisher in publishers:
                with contextlib.suppress(Exception):
                    publisher.shutdown()
            publishers[:] = _publishers(endpoint, returned)

        def end(reason: str) -> None:
            log.error(reason)
            ended.append(reason)
            runtime.shutdown()

        follower = DaemonFollower(
            client,
            endpoint,
            welcome,
            setup=setup,
            republish=republish,
            watch_load=lambda: client.watch_load(on_load),
            end=end,
        )
        following = asyncio.ensure_future(follower.run())
        generate = _gated(handler, follower)
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
            await endpoint.serve_endpoint(
                generate, graceful_shutdown=True, metrics_labels=[("model", name)]
            )
        finally:
            following.cancel()
        log.info("engined dynamo-worker stopped", in_flight=handler.in_flight)
        return 1 if ended else 0
    finally:
        for publisher in publishers:
            with contextlib.suppress(Exception):
                publisher.shutdown()
        if handler is not None:
            await handler.close()
        await client.close()


def _gated(
    handler: RequestHandler, follower: DaemonFollower
) -> Callable[[dict[str, Any], Context], AsyncIterator[Chunk]]:
    """`handler.generate`, refused with `EngineShutdown` (migratable) while the daemon is
    gone or not set up again: a request must never reach a daemon without its vocabulary."""

    async def generate(request: dict[str, Any], context: Context) -> AsyncIterator[Chunk]:
        if not follower.serving:
            raise daemon_gone()
        async for chunk in handler.generate(request, context):
            yield chunk

    return generate
