"""The `engined` command line: argument plumbing only.

Every decision lives elsewhere: settings, their layering and validation in `engined.config`,
the daemon in `engined.server.daemon`. This module turns options into a flags dict, errors into
exit codes, and nothing more. Each subcommand is one function registered on `app`; the client
subcommands (submit, events, fpm, stats, bench) are added the same way.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from engined.config import FLAGS, ConfigError, Flag, dump_config, load_config

# Exit codes. 2 is what typer/click use for a bad command line; a bad configuration is the same
# kind of mistake. STARTUP_FAILURE follows uvicorn: the configuration was fine but the daemon
# never started (e.g. an endpoint is already bound).
CONFIG_ERROR = 2
STARTUP_FAILURE = 3

app = typer.Typer(
    name="engined",
    help="A GPU-free stand-in for a vLLM engine.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _root() -> None:
    """A GPU-free stand-in for a vLLM engine: Dynamo mocker scheduling, vLLM wire formats."""
    # NOTE: an explicit callback keeps `serve` a subcommand; with a single command and no
    # callback typer would run it for a bare `engined`.


# --- serve ------------------------------------------------------------------------------------


def serve(config: Path | None, print_config: bool, **options: Any) -> None:
    """Run the daemon. Settings: defaults < --config TOML < ENGINED_* environment < flags."""
    flags = {flag.key: options[flag.dest] for flag in FLAGS if options[flag.dest] is not None}
    try:
        effective = load_config(config_path=config, env=os.environ, flags=flags)
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(CONFIG_ERROR) from None
    if print_config:
        typer.echo(dump_config(effective), nl=False)
        return
    # NOTE: imported here so `--print-config` and `--help` never load the server stack.
    from engined.server.daemon import run

    raise typer.Exit(run(effective))


def _flag_option(flag: Flag) -> inspect.Parameter:
    """A typer option for one FLAGS entry; None by default so only given flags override.

    Values stay text (`str | None`) and are parsed by `load_config`, so a bad value gets the
    same message, naming the key, whether it came from a flag, the environment or the file.
    """
    if flag.is_switch:
        annotation: Any = Annotated[
            bool | None,
            typer.Option(
                f"{flag.name}/{flag.negation}",
                help=flag.help,
                rich_help_panel=flag.section.capitalize(),
                show_default=False,
            ),
        ]
    else:
        annotation = Annotated[
            str | None,
            typer.Option(
                flag.name,
                help=flag.help,
                metavar=flag.metavar,
                rich_help_panel=flag.section.capitalize(),
                show_default=False,
            ),
        ]
    return inspect.Parameter(
        flag.dest, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation
    )


def _with_flag_options(command: Callable[..., None]) -> Callable[..., None]:
    """Declare `--config`, `--print-config` and one option per FLAGS entry on `command`.

    typer reads options from the signature; building it from FLAGS keeps each flag declared
    once (in `engined.config`) instead of once there and once as a parameter here.
    """
    fixed = [
        inspect.Parameter(
            "config",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[
                Path | None,
                typer.Option(
                    "--config", help="TOML file: daemon keys and an `engine` table.", dir_okay=False
                ),
            ],
        ),
        inspect.Parameter(
            "print_config",
            inspect.Parameter.KEYWORD_ONLY,
            default=False,
            annotation=Annotated[
                bool,
                typer.Option(
                    "--print-config", help="Print the effective configuration as TOML and exit."
                ),
            ],
        ),
    ]
    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*fixed, *(_flag_option(flag) for flag in FLAGS)]
    )
    return command


app.command("serve")(_with_flag_options(serve))


def main() -> None:
    """Console-script entry point (`engined`)."""
    app()


if __name__ == "__main__":
    main()
