"""The model cards the worker puts in Dynamo's discovery: the base model's, and one per loaded
LoRA adapter.

Apart from the worker's start-up because the adapters' cards come and go while it serves
(`engined.dynamo.lora`), and both kinds must agree on what the disaggregation mode makes the
worker (model type, worker type, the peers it needs). What each card carries is what
dynamo.vllm registers: the base card the engine's real limits (`_runtime_config`), an
adapter's card what `_register_lora_discovery` gives it (dynamo/vllm/handlers.py).
"""

from __future__ import annotations

import json
from typing import Any

from engined.dynamo.startup import dynamo_step
from engined.dynamo.worker_args import DisaggregationMode, WorkerArgs
from engined.wire.control import Welcome


def publishes_kv_events(welcome: Welcome) -> bool:
    """Whether the daemon's ranks publish KV events a router can index.

    A daemon with `kv_events_endpoint = ""` (vLLM's `enable_kv_cache_events: false`) is
    registered without them, as dynamo.vllm registers such an engine: Dynamo's KV router then
    warns that the worker's publisher is disabled, or, with `--no-kv-events`, predicts cache
    state from its own routing decisions.
    """
    return bool(welcome.enable_prefix_caching and welcome.kv_events_endpoints)


def _set_token_budget(config: Any, context: int) -> None:
    """The frontend refuses prompts (and prompt + max_tokens) past the context up front, as
    dynamo.vllm asks it to (`dynamo/vllm/capacity.py`), on the base card and adapters' alike."""
    budget = {
        "combined_limit": context,
        "reject_prompt_overflow": True,
        "reject_total_overflow": True,
    }
    config.set_engine_specific("token_budget", json.dumps(budget))


def _set_ranks(config: Any, welcome: Welcome, rank: int | None) -> None:
    """The card's data-parallel range: all of the daemon's ranks, or `[rank, rank + 1)` for
    one rank served as a worker of its own (`--worker-per-rank`, engined.dynamo.cluster)."""
    config.data_parallel_start_rank = 0 if rank is None else rank
    config.data_parallel_size = welcome.dp_size if rank is None else 1


def runtime_config(welcome: Welcome, context: int, rank: int | None = None) -> Any:
    """The base card's runtime config: the daemon's limits, for all of its ranks or `rank`."""
    from dynamo.llm import ModelRuntimeConfig

    config = ModelRuntimeConfig()
    config.context_length = context
    config.total_kv_blocks = welcome.num_gpu_blocks  # per rank, as Dynamo wants it
    config.max_num_seqs = welcome.max_num_seqs
    config.max_num_batched_tokens = welcome.max_num_batched_tokens
    _set_ranks(config, welcome, rank)
    # The worker-local indexer (kept by each rank's KvEventPublisher) is what a restarted
    # frontend, or one started later, asks for this worker's cached blocks; without it a new
    # router starts blind ("KV source is live-only"). dynamo.vllm turns it on for every worker
    # that publishes KV events, decode workers included, and has no flag to turn it off.
    config.enable_local_indexer = publishes_kv_events(welcome)
    config.kv_event_publishing_enabled = publishes_kv_events(welcome)
    _set_token_budget(config, context)
    return config


def adapter_runtime_config(welcome: Welcome, context: int, rank: int | None = None) -> Any:
    """An adapter card's runtime config: what dynamo.vllm's `_register_lora_discovery` sets on
    a fresh one (the data-parallel range, the context and its token budget, whether KV events
    are published), not the engine's limits, which only the base card carries."""
    from dynamo.llm import ModelRuntimeConfig

    config = ModelRuntimeConfig()
    _set_ranks(config, welcome, rank)
    config.context_length = context
    _set_token_budget(config, context)
    config.kv_event_publishing_enabled = publishes_kv_events(welcome)
    return config


def _types(mode: DisaggregationMode) -> tuple[Any, Any, list[list[Any]]]:
    """(model type, worker type, needs) of a card registered by a worker in `mode`."""
    from dynamo.llm import ModelType, WorkerType

    if mode is DisaggregationMode.PREFILL:
        # ModelType.Prefill is the legacy marker older frontends detect prefill by.
        return ModelType.Prefill, WorkerType.Prefill, [[WorkerType.Decode]]
    chat_and_completions = ModelType.Chat | ModelType.Completions
    if mode is DisaggregationMode.DECODE:
        return chat_and_completions, WorkerType.Decode, [[WorkerType.Prefill]]
    return chat_and_completions, WorkerType.Aggregated, []


def lora_capacity(args: WorkerArgs) -> int | None:
    """`max_gpu_lora_count` of the cards: `--max-loras` with `--enable-lora` (dynamo.vllm
    advertises it on the base card so the frontend can place a first adapter), else none."""
    return args.max_loras if args.enable_lora else None


async def register(
    args: WorkerArgs, endpoint: Any, name: str, welcome: Welcome, config: Any
) -> None:
    """Register the base model on `endpoint` as the disaggregation mode's worker type.

    Raises:
        SetupError: Dynamo refused it.
    """
    from dynamo.llm import ModelInput, register_model

    model_type, worker_type, needs = _types(args.disaggregation_mode)
    with dynamo_step("Dynamo refused to register the model"):
        await register_model(
            ModelInput.Tokens,
            model_type,
            endpoint,
            str(args.model_path),
            name,
            worker_type=worker_type,
            needs=needs,
            kv_cache_block_size=welcome.block_size,
            runtime_config=config,
            max_gpu_lora_count=lora_capacity(args),
        )


async def register_adapter(
    args: WorkerArgs, endpoint: Any, welcome: Welcome, config: Any, lora_name: str, lora_id: int
) -> None:
    """Publish a loaded adapter's card on `endpoint`, as `_register_lora_discovery` does: the
    base model's path, the adapter's name, `user_data` marking it with its id, no weights.
    A refusal propagates (the load answers it as Dynamo's error)."""
    from dynamo.llm import ModelInput, register_model

    model_type, worker_type, needs = _types(args.disaggregation_mode)
    await register_model(
        model_input=ModelInput.Tokens,
        model_type=model_type,
        endpoint=endpoint,
        model_path=str(args.model_path),
        kv_cache_block_size=welcome.block_size,
        runtime_config=config,
        user_data={"lora_adapter": True, "lora_id": lora_id},
        lora_name=lora_name,
        base_model_path=str(args.model_path),
        worker_type=worker_type,
        needs=needs,
        ignore_weights=True,
        max_gpu_lora_count=lora_capacity(args),
    )


async def unregister_adapter(endpoint: Any, lora_name: str) -> None:
    """Take an adapter's card out of discovery (`_unregister_lora_discovery`)."""
    from dynamo.llm import unregister_model

    await unregister_model(endpoint=endpoint, lora_name=lora_name)
