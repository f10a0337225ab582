"""The options the operator commands share (endpoint, timeout, output, rank, count, duration)
and the running of a tool under them.

Apart from `engined.cli.tool_commands` so that each command there reads as its own options;
these are the ones every command takes alike, with their parsers and help panels.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Annotated, Any

import typer

from engined.config import ENV_PREFIX
from engined.tools.distributions import parse_distribution
from engined.tools.option_values import check_endpoint, positive_float

if TYPE_CHECKING:
    from engined.tools.common import Output


CONNECTION_PANEL = "Connection"
OUTPUT_PANEL = "Output"
LOAD_PANEL = "Load"


def _checked(parse: Callable[[str], Any]) -> Callable[[Any], Any]:
    """A typer `parser` from a ValueError-raising function: exit 2, naming the option.

    typer also passes defaults through the parser; values that are not text are already parsed.
    """

    def parser(value: Any) -> Any:
        if not isinstance(value, str):
            return value
        try:
            return parse(value)
        except ValueError as error:
            raise typer.BadParameter(str(error)) from None

    return parser


checked_endpoint = _checked(check_endpoint)
checked_seconds = _checked(positive_float)
checked_distribution = _checked(parse_distribution)

ControlEndpoint = Annotated[
    str,
    typer.Option(
        "--control-endpoint",
        envvar=f"{ENV_PREFIX}CONTROL_ENDPOINT",
        parser=checked_endpoint,
        metavar="ENDPOINT",
        help="The daemon's control socket; its other sockets are discovered from `welcome`.",
        rich_help_panel=CONNECTION_PANEL,
    ),
]
Timeout = Annotated[
    float,
    typer.Option(
        "--timeout",
        parser=checked_seconds,
        metavar="SECONDS",
        help="How long to wait for each reply of the daemon.",
        rich_help_panel=CONNECTION_PANEL,
    ),
]
JsonLines = Annotated[
    bool,
    typer.Option(
        "--json",
        help="One JSON object per line with stable keys (default: tables on a terminal, "
        "plain text otherwise).",
        rich_help_panel=OUTPUT_PANEL,
    ),
]
# NOTE: `--dp-rank` is the protocol's name (`submit`'s `dp_rank`), used by every command;
# `--rank`, the first spelling of `events` and `fpm`, stays as an alias (flags are a contract).
Rank = Annotated[
    int,
    typer.Option(
        "--dp-rank",
        "--rank",
        min=0,
        help="Data-parallel rank to watch (alias: --rank).",
        rich_help_panel=CONNECTION_PANEL,
    ),
]
Count = Annotated[
    int | None,
    typer.Option("--count", min=1, metavar="N", help="Stop after N messages.", show_default=False),
]
Duration = Annotated[
    float | None,
    typer.Option(
        "--duration",
        parser=checked_seconds,
        metavar="SECONDS",
        help="Stop after this many seconds.",
        show_default=False,
    ),
]


def run_command(json_lines: bool, main: Callable[[Output], Coroutine[Any, Any, int]]) -> None:
    """Run a tool and exit with its code; its UsageError is reported as a bad option (2)."""
    from engined.tools.common import Output, UsageError, run_tool

    out = Output.pick(json_lines)
    try:
        code = run_tool(lambda: main(out), out)
    except UsageError as error:
        hint = " / ".join(f"'{option}'" for option in error.options)
        raise typer.BadParameter(error.message, param_hint=hint) from None
    raise typer.Exit(code)
