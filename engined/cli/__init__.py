"""The `engined` command line: argument plumbing only.

Every decision lives elsewhere: settings, their layering and validation in `engined.config`,
the daemon in `engined.server.daemon`, the operator commands (submit, events, fpm, stats,
bench, and the engine-wide pause, sleep and weight-version ones) in `engined.tools`. This
package turns options into a flags dict or an options dataclass, errors into exit codes, and
nothing more. Each subcommand is one function, registered on `app` here: `serve` (with its
flag options) in `serve`, the operator commands in `tool_commands` and `engine_commands` (the
options they share in `tool_options`), `dynamo-worker` in `dynamo_worker`.
"""

from __future__ import annotations

from typing import Annotated

import typer

from engined import __version__
from engined.cli import dynamo_worker, engine_commands, tool_commands
from engined.cli.serve import CONFIG_ERROR, STARTUP_FAILURE, ServeCommand, serve_command
from engined.core import build as core_build

__all__ = ["CONFIG_ERROR", "STARTUP_FAILURE", "app", "main"]

app = typer.Typer(
    name="engined",
    help="A GPU-free stand-in for a vLLM engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"engined {__version__}")
        # Which core runs (compiled, or pure and why: engined.core.core_build): on stderr, so
        # stdout stays the bare version scripts parse.
        typer.echo(f"core: {core_build()}", err=True)
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            callback=_print_version,
            is_eager=True,
            help="Print the version and exit.",
        ),
    ] = False,
) -> None:
    """A GPU-free stand-in for a vLLM engine: Dynamo mocker scheduling, vLLM wire formats."""
    # NOTE: an explicit callback keeps `serve` a subcommand; with a single command and no
    # callback typer would run it for a bare `engined`.


app.command("serve", cls=ServeCommand)(serve_command)
app.command("submit")(tool_commands.submit)
app.command("events")(tool_commands.events)
app.command("fpm")(tool_commands.fpm)
app.command("stats")(tool_commands.stats)
app.command("bench")(tool_commands.bench)
app.command("pause")(engine_commands.pause)
app.command("resume")(engine_commands.resume)
app.command("sleep")(engine_commands.sleep)
app.command("wake-up")(engine_commands.wake_up)
app.command("release-kv-cache")(engine_commands.release_kv_cache)
app.command("reset-prefix-cache")(engine_commands.reset_prefix_cache)
app.command("set-weight-version")(engine_commands.set_weight_version)
app.command("cancel")(engine_commands.cancel)
app.command(
    "dynamo-worker",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)(dynamo_worker.dynamo_worker)


def main() -> None:
    """Entry point of the `engined` console script and of `python -m engined`."""
    app(prog_name="engined")
