"""The engine-wide operator commands: vLLM's pause, sleep, KV release, cache reset and weight
version, each one control message, and `cancel` of requests by id (engined.tools.engine_control
does the talking; it is imported inside the commands, so `serve` and `--help` never load it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Annotated, Literal

import typer

from engined.cli.tool_options import ControlEndpoint, JsonLines, Timeout, run_command
from engined.tools.option_values import DEFAULT_CONTROL_ENDPOINT, DEFAULT_TIMEOUT

if TYPE_CHECKING:
    from engined.client import EngineClient
    from engined.tools.engine_control import Call

Mode = Annotated[
    Literal["abort", "wait", "keep"],
    typer.Option(
        "--mode",
        help="abort: end every request; wait: let the running finish; keep: freeze them.",
    ),
]


def _run(control_endpoint: str, timeout: float, json_lines: bool, call: Call) -> None:
    from engined.tools import engine_control as tool

    run_command(json_lines, lambda out: tool.engine_call(control_endpoint, timeout, out, call))


def pause(
    mode: Mode = "abort",
    clear_cache: Annotated[
        bool, typer.Option("--clear-cache/--keep-cache", help="Clear the prefix cache once paused.")
    ] = True,
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Pause generation on every rank, as vLLM's pause_generation (returns once paused)."""

    async def call(client: EngineClient, wait: float) -> object:
        return await client.pause(mode, clear_cache, timeout=wait)

    _run(control_endpoint, timeout, json_lines, call)


def sleep(
    level: Annotated[int, typer.Option("--level", min=0, max=2, help="0-2, as vLLM's.")] = 1,
    mode: Mode = "abort",
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Put every rank to sleep, as vLLM's sleep (returns once asleep)."""

    async def call(client: EngineClient, wait: float) -> object:
        return await client.sleep(level, mode, timeout=wait)

    _run(control_endpoint, timeout, json_lines, call)


def wake_up(
    tags: Annotated[
        list[str] | None,
        typer.Option("--tag", help="A pool to wake: kv_cache, weights (repeat; none: all)."),
    ] = None,
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Wake the named pools of every rank, as vLLM's wake_up."""

    async def call(client: EngineClient, wait: float) -> object:
        return await client.wake_up(tags or None, timeout=wait)

    _run(control_endpoint, timeout, json_lines, call)


def reset_prefix_cache(
    reset_running_requests: Annotated[
        bool,
        typer.Option("--reset-running-requests", help="Preempt the running requests first."),
    ] = False,
    dp_rank: Annotated[
        int | None, typer.Option("--dp-rank", min=0, help="One rank (default: all).")
    ] = None,
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Clear the prefix cache, as vLLM's reset_prefix_cache."""

    async def call(client: EngineClient, wait: float) -> object:
        return await client.reset_prefix_cache(
            dp_rank, reset_running_requests=reset_running_requests, timeout=wait
        )

    _run(control_endpoint, timeout, json_lines, call)


def set_weight_version(
    version: Annotated[str, typer.Argument(help="The label of the weights now loaded.")],
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Label the weights of every rank, as vLLM's update_weight_version."""

    async def call(client: EngineClient, wait: float) -> object:
        return await client.set_weight_version(version, timeout=wait)

    _run(control_endpoint, timeout, json_lines, call)


def cancel(
    request_ids: Annotated[
        list[str],
        typer.Argument(help="Request ids, as the clients that submitted them named them."),
    ],
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Cancel requests by id, whoever submitted them (an operator's); exit 1 if one was not
    running."""
    from engined.tools import engine_control as tool

    run_command(
        json_lines, lambda out: tool.cancel_requests(control_endpoint, timeout, out, request_ids)
    )


def _without_arguments(call: Call, doc: str) -> Callable[..., None]:
    """A command whose only options are the connection and output ones."""

    def command(
        control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
        timeout: Timeout = DEFAULT_TIMEOUT,
        json_lines: JsonLines = False,
    ) -> None:
        _run(control_endpoint, timeout, json_lines, call)

    command.__doc__ = doc
    return command


resume = _without_arguments(
    lambda client, wait: client.resume(timeout=wait), "Resume generation on every rank."
)
release_kv_cache = _without_arguments(
    lambda client, wait: client.release_kv_cache_memory(timeout=wait),
    "Release the KV cache of every rank after a pause, as vLLM's release_kv_cache_memory.",
)
