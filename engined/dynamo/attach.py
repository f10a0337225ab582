"""The worker's side of its daemon: connecting, checking it, and the set-up it sends.

The set-up (the model's vocabulary, the FPM worker id of each served rank) lives on the
daemon, so it is sent at start-up and again whenever the daemon restarts
(engined/dynamo/recovery.py): a daemon without it answers with empty text.
"""

from __future__ import annotations

import os
from collections.abc import Awaitable, Callable, Sequence

import structlog

from engined.client import EngineClient, EngineError
from engined.dynamo.model import (
    SetupError,
    check_role,
    context_length,
    read_model,
    reconcile_vocabulary,
)
from engined.dynamo.startup import bound_connection_waits, check_system_port
from engined.dynamo.worker_args import WorkerArgs
from engined.wire.control import Welcome

log = structlog.get_logger(__name__)


async def connect_daemon(args: WorkerArgs) -> EngineClient:
    """The client the worker follows its daemon with (`--daemon-liveness` is its bound)."""
    check_system_port(os.environ)
    bound_connection_waits(os.environ, args.connect_timeout)
    try:
        return await EngineClient.connect(args.control_endpoint, liveness_s=args.daemon_liveness)
    except ValueError as error:  # the CURVE key files the environment names
        raise SetupError(str(error)) from None


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
        # A short-lived side connection: no liveness watch of its own.
        async with await EngineClient.connect(endpoint, liveness_s=None) as operator:
            await command(operator)
    except EngineError as exc:
        raise SetupError(f"the daemon refused {what}: {exc.message}") from None
    except TimeoutError:
        raise SetupError(
            f"the daemon's operator endpoint {endpoint} did not answer for {what}: run the "
            "worker as the daemon's user (docs/security.md §2)"
        ) from None


async def attach(client: EngineClient, args: WorkerArgs) -> tuple[Welcome, int]:
    """Check the daemon against the model and adapt its vocabulary; (welcome, context)."""
    model = read_model(args.model_path)
    welcome = await _hello(client, args)
    check_role(args.disaggregation_mode.value, welcome)
    if welcome.max_model_len is None or welcome.max_num_seqs is None:
        raise SetupError(
            f"the daemon at {args.control_endpoint} (engined {welcome.version}) is too old "
            "for dynamo-worker: upgrade it"
        )
    await set_vocabulary(client, args, welcome)
    return welcome, context_length(model, welcome.max_model_len)


async def set_vocabulary(client: EngineClient, args: WorkerArgs, welcome: Welcome) -> None:
    """The model's vocabulary on the daemon, at start-up and on every restart of it."""
    vocabulary = reconcile_vocabulary(read_model(args.model_path), welcome)
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


async def set_fpm_worker_ids(
    client: EngineClient, args: WorkerArgs, welcome: Welcome, ids: Sequence[tuple[int | None, int]]
) -> None:
    """Stamp FPM with the Dynamo worker id the planner joins it by (dynamo.vllm stamps the
    endpoint's connection id): `(None, id)` for every rank, `(rank, id)` for one rank."""
    for rank, worker_id in ids:
        what = "the FPM worker id" if rank is None else f"the FPM worker id of rank {rank}"
        await as_operator(
            client, welcome, args.control_endpoint, what, _stamp(str(worker_id), rank)
        )


def _stamp(worker_id: str, rank: int | None) -> Callable[[EngineClient], Awaitable[object]]:
    def command(client: EngineClient) -> Awaitable[object]:
        return client.set_fpm_worker_id(worker_id, dp_rank=rank)

    return command
