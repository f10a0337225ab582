"""`engined serve`: one typer option per `FLAGS` entry, and the plain `--help` layout."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from engined.config import (
    FLAGS,
    ConfigError,
    DaemonConfig,
    Flag,
    dump_config,
    load_config,
)

# Exit codes. 2 is what typer/click use for a bad command line; a bad configuration is the same
# kind of mistake. STARTUP_FAILURE follows uvicorn: the configuration was fine but the daemon
# never started (e.g. an endpoint is already bound).
CONFIG_ERROR = 2
STARTUP_FAILURE = 3


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


def _default_text(flag: Flag, defaults: DaemonConfig) -> str:
    """How `--help` shows the built-in default of `flag` (`""` for unset, as flags spell it)."""
    value: Any = defaults
    for part in flag.key.split("."):
        value = getattr(value, part)
    if flag.is_switch:
        return (flag.name if value else flag.negation).removeprefix("--")
    if value is None or value == "" or value == ():
        return '""'
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value)
    return str(value)


def _flag_option(flag: Flag, defaults: DaemonConfig) -> inspect.Parameter:
    """A typer option for one FLAGS entry; None by default so only given flags override.

    Values stay text (`str | None`) and are parsed by `load_config`, so a bad value gets the
    same message, naming the key, whether it came from a flag, the environment or the file.
    The help shows the built-in default (the option's own default is None, so typer cannot).
    """
    help_text = f"{flag.help}  [default: {_default_text(flag, defaults)}]"
    if flag.is_switch:
        annotation: Any = Annotated[
            bool | None,
            typer.Option(
                f"{flag.name}/{flag.negation}",
                help=help_text,
                rich_help_panel=flag.section.capitalize(),
                show_default=False,
            ),
        ]
    else:
        annotation = Annotated[
            str | None,
            typer.Option(
                flag.name,
                help=help_text,
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
    defaults = load_config(config_path=None, env={}, flags={})
    command.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [*fixed, *(_flag_option(flag, defaults) for flag in FLAGS)]
    )
    return command


class PlainHelpCommand(TyperCommand):
    """A command whose `--help` is click's plain two-column layout, one panel per section.

    `serve` has some 50 options, several with long names (`--no-enable-chunked-prefill`);
    rich's four-column table squeezes them into truncated names and one-word help lines at 80
    columns, while the plain layout puts a long name on its own line and wraps the help under it.
    """

    def format_help(self, ctx: Any, formatter: Any) -> None:
        self.rich_markup_mode = None
        super().format_help(ctx, formatter)

    def format_options(self, ctx: Any, formatter: Any) -> None:
        sections: dict[str, list[tuple[str, str]]] = {}
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None:
                panel = getattr(param, "rich_help_panel", None) or "Options"
                sections.setdefault(panel, []).append(record)
        for title, records in sections.items():
            with formatter.section(title if title == "Options" else f"{title} options"):
                formatter.write_dl(records)


serve_command = _with_flag_options(serve)
