"""`engined serve`: one typer option per `FLAGS` entry, and the plain `--help` layout."""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer
from typer.core import TyperCommand

from engined.cli.vllm_configs import NAMES as VLLM_CONFIG_NAMES
from engined.cli.vllm_configs import config_keys, parameters
from engined.cli.vllm_flags import MANY_VALUES, ONE_VALUE, OPTIONAL_VALUE, SWITCHES
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


def serve(
    config: Path | None,
    print_config: bool,
    model_tag: str | None,
    **options: Any,
) -> None:
    """Run the daemon. Settings: defaults < --config TOML < ENGINED_* environment < flags."""
    json_options = {name: options.pop(name) for name in VLLM_CONFIG_NAMES}
    flags = {
        flag.key: tuple(value) if isinstance(value, list) else value
        for flag in FLAGS
        if (value := options[flag.dest]) is not None and value != []
    }
    try:
        if model_tag is not None:
            if flags.get("model", model_tag) != model_tag:
                raise ConfigError(
                    f"model: given twice, as {model_tag!r} and as --model {flags['model']!r}",
                    key="model",
                )
            flags["model"] = model_tag
        flags = config_keys(json_options, flags, lambda warning: typer.echo(warning, err=True))
        given: set[str] = set()
        effective = load_config(config_path=config, env=os.environ, flags=flags, given=given)
    except ConfigError as error:
        for problem in error.problems:
            typer.echo(f"error: {problem}", err=True)
        raise typer.Exit(CONFIG_ERROR) from None
    if print_config:
        typer.echo(dump_config(effective), nl=False)
        return
    # NOTE: imported here: the tokenizer stack is not needed to print the configuration.
    from engined.openai.launch import with_model
    from engined.openai.served_models import check_startup

    try:
        effective = with_model(
            effective,
            vocab_given=effective.engine.vocab_size is not None,
            max_model_len_given=effective.engine.max_model_len is not None,
            budget_given="engine.max_num_batched_tokens" in given,
        )
        check_startup(effective, os.environ)
    except ConfigError as error:
        typer.echo(f"error: {error}", err=True)
        raise typer.Exit(CONFIG_ERROR) from None
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
    repeat = ""
    if flag.repeated:
        repeat = " Repeat it for several."
    elif flag.many:
        repeat = " One or more values after it, as vLLM's; given again, the last one's win."
    help_text = f"{flag.help}{repeat}  [default: {_default_text(flag, defaults)}]"
    if flag.is_switch:
        annotation: Any = Annotated[
            bool | None,
            typer.Option(
                f"{flag.name}/{flag.negation}",
                *flag.aliases,
                help=help_text,
                rich_help_panel=flag.section.capitalize(),
                show_default=False,
            ),
        ]
    elif flag.repeated or flag.many:
        annotation = Annotated[
            list[str] | None,
            typer.Option(
                flag.name,
                *flag.aliases,
                help=help_text,
                metavar=flag.metavar,
                rich_help_panel=flag.section.capitalize(),
                show_default=False,
            ),
        ]
    else:
        annotation = Annotated[
            str | None,
            typer.Option(
                flag.name,
                *flag.aliases,
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
            "model_tag",
            inspect.Parameter.KEYWORD_ONLY,
            default=None,
            annotation=Annotated[
                str | None,
                typer.Argument(
                    metavar="MODEL",
                    help="vLLM's MODEL: a local model directory or a name in the Hugging Face "
                    "cache (the `model` key; default: engined's embedded model).",
                    show_default=False,
                ),
            ],
        ),
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
        [
            *fixed,
            *(_flag_option(flag, defaults) for flag in FLAGS),
            *parameters(),
        ]
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


class ServeCommand(PlainHelpCommand):
    """`engined serve`, which also takes a `vllm serve` command line unchanged.

    vLLM's options that engined does not model are dropped with their values before click
    parses (one warning names them); `--snake_case` spellings are read as vLLM's parser
    reads them. Options in neither set still fail as unknown, so typos surface.
    """

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        kept, ignored = split_vllm_only(args, self._own_options(ctx))
        if ignored:
            typer.echo(
                "engined serve: ignoring vLLM options engined does not model: "
                + ", ".join(ignored),
                err=True,
            )
        return super().parse_args(ctx, kept)

    def _own_options(self, ctx: Any) -> dict[str, bool]:
        """engined's option names, each with whether it takes a value."""
        names: dict[str, bool] = {}
        for param in self.get_params(ctx):
            takes_value = not getattr(param, "is_flag", False)
            for name in (*param.opts, *getattr(param, "secondary_opts", ())):
                if name.startswith("-"):
                    names[name] = takes_value
        return names


SERVED_MODEL_NAME = "--served-model-name"
# engined's own options that take vLLM's `nargs="+"` (`Flag.many`).
MANY_OWN = frozenset(flag.name for flag in FLAGS if flag.many)


def split_vllm_only(args: list[str], own: dict[str, bool]) -> tuple[list[str], list[str]]:
    """`args` without vLLM's options that engined does not have, and those options' names.

    `own` maps engined's option names to whether they take a value, so that a value such as
    `--rank-processes -1` is never read as an option. An option of `MANY_OWN` takes every
    word up to the next option, and only its last occurrence counts, as in vLLM; its values
    are passed on one per option, as click's list options take them (and one with no value
    alone, for click to refuse).
    """
    kept: list[str] = []
    ignored: list[str] = []
    many: dict[str, list[str]] = {}
    rest: list[str] = []
    index = 0
    while index < len(args):
        token = args[index]
        index += 1
        if token == "--":
            rest = args[index - 1 :]
            break
        if not token.startswith("-") or token == "-":
            kept.append(token)
            continue
        name, equals, value = token.partition("=")
        if name.startswith("--"):
            name = "--" + name[2:].replace("_", "-")
        token = name + equals + value
        if name in MANY_OWN:
            values = [value] if equals else []
            while not equals and index < len(args) and not args[index].startswith("-"):
                values.append(args[index])
                index += 1
            many[name] = values
            continue
        if name == SERVED_MODEL_NAME and not equals:
            # vLLM's `nargs="+"`: every word up to the next option is a served name; the
            # first is model_name, the others aliases (as argparse reads it, greedily).
            names = []
            while index < len(args) and not args[index].startswith("-"):
                names.append(args[index])
                index += 1
            kept.extend((name, *names[:1]))
            for alias in names[1:]:
                kept.extend(("--model-aliases", alias))
            continue
        if name in own:
            kept.append(token)
            if own[name] and not equals and index < len(args):
                kept.append(args[index])
                index += 1
            continue
        if name in SWITCHES:
            ignored.append(name)
        elif name in ONE_VALUE:
            ignored.append(name)
            if not equals:
                index += 1
        elif name in MANY_VALUES or name in OPTIONAL_VALUE:
            ignored.append(name)
            if not equals:
                while index < len(args) and not args[index].startswith("-"):
                    index += 1
                    if name in OPTIONAL_VALUE:
                        break
        else:
            kept.append(token)
    for name, values in many.items():
        kept.extend(name if not values else f"{name}={value}" for value in values or [""])
    return kept + rest, ignored
