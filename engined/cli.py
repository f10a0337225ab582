"""The `engined` command line: argument plumbing only.

Every decision lives elsewhere: settings, their layering and validation in `engined.config`,
the daemon in `engined.server.daemon`, the operator commands (submit, events, fpm, stats,
bench) in `engined.tools`. This module turns options into a flags dict or an options
dataclass, errors into exit codes, and nothing more. Each subcommand is one function
registered on `app`.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import typer
from typer.core import TyperCommand

from engined import __version__
from engined.config import (
    ENV_PREFIX,
    FLAGS,
    ConfigError,
    DaemonConfig,
    Flag,
    dump_config,
    load_config,
)
from engined.tools.args import (
    DEFAULT_CONTROL_ENDPOINT,
    DEFAULT_TIMEOUT,
    check_endpoint,
    parse_token_list,
    positive_float,
)
from engined.tools.distributions import (
    DEFAULT_OUTPUT_LEN,
    DEFAULT_PROMPT_LEN,
    Distribution,
    parse_distribution,
)

if TYPE_CHECKING:
    from engined.tools.common import Output

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


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"engined {__version__}")
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


class _PlainHelpCommand(TyperCommand):
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


app.command("serve", cls=_PlainHelpCommand)(_with_flag_options(serve))


# --- operator commands: submit, events, fpm, stats, bench --------------------------------------
# Each turns its options into the options dataclass of its module in `engined.tools` and runs
# it there. The tools are imported inside the commands, so `serve` and `--help` never load
# them (nor ZeroMQ or rich).

_CONNECTION = "Connection"
_OUTPUT = "Output"
_LOAD = "Load"


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


_endpoint = _checked(check_endpoint)
_seconds = _checked(positive_float)
_distribution = _checked(parse_distribution)

ControlEndpoint = Annotated[
    str,
    typer.Option(
        "--control-endpoint",
        envvar=f"{ENV_PREFIX}CONTROL_ENDPOINT",
        parser=_endpoint,
        metavar="ENDPOINT",
        help="The daemon's control socket; its other sockets are discovered from `welcome`.",
        rich_help_panel=_CONNECTION,
    ),
]
Timeout = Annotated[
    float,
    typer.Option(
        "--timeout",
        parser=_seconds,
        metavar="SECONDS",
        help="How long to wait for each reply of the daemon.",
        rich_help_panel=_CONNECTION,
    ),
]
JsonLines = Annotated[
    bool,
    typer.Option(
        "--json",
        help="One JSON object per line with stable keys (default: tables on a terminal, "
        "plain text otherwise).",
        rich_help_panel=_OUTPUT,
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
        rich_help_panel=_CONNECTION,
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
        parser=_seconds,
        metavar="SECONDS",
        help="Stop after this many seconds.",
        show_default=False,
    ),
]


def _run(json_lines: bool, main: Callable[[Output], Coroutine[Any, Any, int]]) -> None:
    """Run a tool and exit with its code; its UsageError is reported as a bad option (2)."""
    from engined.tools.common import Output, UsageError, run_tool

    out = Output.pick(json_lines)
    try:
        code = run_tool(lambda: main(out), out)
    except UsageError as error:
        raise typer.BadParameter(error.message, param_hint=f"'{error.option}'") from None
    raise typer.Exit(code)


@app.command("submit")
def submit(
    token_ids: Annotated[
        list[int] | None,
        typer.Argument(metavar="[TOKEN_ID]...", help="Prompt token ids.", show_default=False),
    ] = None,
    tokens: Annotated[
        str | None,
        typer.Option("--tokens", metavar="IDS", help="Prompt token ids as 1,2,3."),
    ] = None,
    random_prompt: Annotated[
        int | None,
        typer.Option("--random-prompt", min=1, metavar="N", help="A random prompt of N tokens."),
    ] = None,
    seed: Annotated[int, typer.Option("--seed", help="Seed of --random-prompt.")] = 0,
    max_tokens: Annotated[
        int, typer.Option("--max-tokens", min=0, help="Tokens to generate (0: prefill only).")
    ] = 16,
    request_id: Annotated[
        str | None,
        typer.Option("--request-id", help="Request id (default: the daemon makes one)."),
    ] = None,
    dp_rank: Annotated[
        int | None,
        typer.Option("--dp-rank", min=0, help="Rank to run on (default: round-robin)."),
    ] = None,
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Submit one request and stream its outputs as they arrive.

    Exit status 0 when it finished (`length`, or `cancelled` by a
    daemon shutdown), 1 on an error reply, a rejection or a timeout.
    Ctrl-C cancels the request on the daemon.
    """
    from engined.tools import submit as tool

    sources = {"TOKEN_ID": token_ids, "--tokens": tokens, "--random-prompt": random_prompt}
    given = [name for name, value in sources.items() if value]
    if len(given) != 1:
        got = f" (got {' and '.join(given)})" if given else ""
        raise typer.BadParameter(
            f"give the prompt once: token ids as arguments, --tokens or --random-prompt{got}",
            param_hint="TOKEN_ID / '--tokens' / '--random-prompt'",
        )
    if token_ids:
        prompt = list(token_ids)
    elif tokens is not None:
        try:
            prompt = parse_token_list(tokens)
        except ValueError as error:
            raise typer.BadParameter(str(error), param_hint="'--tokens'") from None
    else:
        assert random_prompt is not None
        prompt = tool.random_prompt(random_prompt, seed)
    options = tool.SubmitOptions(
        control_endpoint=control_endpoint,
        token_ids=prompt,
        max_tokens=max_tokens,
        request_id=request_id,
        dp_rank=dp_rank,
        timeout=timeout,
    )
    _run(json_lines, lambda out: tool.submit(options, out))


@app.command("events")
def events(
    rank: Rank = 0,
    replay_from: Annotated[
        int | None,
        typer.Option(
            "--replay-from",
            min=0,
            metavar="SEQ",
            help="First show the buffered batches from SEQ on (replay socket), then follow.",
            show_default=False,
        ),
    ] = None,
    follow: Annotated[
        bool,
        typer.Option(
            "--follow/--no-follow", help="Follow the live stream (--no-follow: replay only)."
        ),
    ] = True,
    count: Count = None,
    duration: Duration = None,
    hash_format: Annotated[
        Literal["hex", "int"] | None,
        typer.Option(
            "--hash-format",
            help="Block hashes as hex or int (default: hex in text, int in JSON).",
            show_default=False,
            rich_help_panel=_OUTPUT,
        ),
    ] = None,
    kv_events_endpoint: Annotated[
        str | None,
        typer.Option(
            "--kv-events-endpoint",
            parser=_endpoint,
            metavar="ENDPOINT",
            help="Subscribe here instead of asking the daemon (any vLLM publisher works).",
            rich_help_panel=_CONNECTION,
        ),
    ] = None,
    kv_replay_endpoint: Annotated[
        str | None,
        typer.Option(
            "--kv-replay-endpoint",
            parser=_endpoint,
            metavar="ENDPOINT",
            help="Replay socket to use instead of the daemon's.",
            rich_help_panel=_CONNECTION,
        ),
    ] = None,
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Follow a rank's KV cache events (either vLLM format), flagging and filling seq gaps.

    A gap in the live stream is reported ({"gap": ...} in JSON) and
    recovered from the replay socket when the daemon has one. --count
    counts messages (batches), replayed ones included.
    """
    from engined.tools import events as tool

    options = tool.EventsOptions(
        control_endpoint=control_endpoint,
        kv_events_endpoint=kv_events_endpoint,
        kv_replay_endpoint=kv_replay_endpoint,
        rank=rank,
        replay_from=replay_from,
        follow=follow,
        count=count,
        duration=duration,
        timeout=timeout,
        hash_format=hash_format,
    )
    _run(json_lines, lambda out: tool.events(options, out))


@app.command("fpm")
def fpm(
    rank: Rank = 0,
    all_ranks: Annotated[
        bool,
        typer.Option("--all-ranks", help="Watch every rank.", rich_help_panel=_CONNECTION),
    ] = False,
    count: Count = None,
    duration: Duration = None,
    fpm_endpoint: Annotated[
        str | None,
        typer.Option(
            "--fpm-endpoint",
            parser=_endpoint,
            metavar="ENDPOINT",
            help="Subscribe here instead of asking the daemon.",
            rich_help_panel=_CONNECTION,
        ),
    ] = None,
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Watch forward-pass metrics: a live table on a terminal, one line per pass otherwise."""
    from engined.tools import fpm as tool

    options = tool.FpmOptions(
        control_endpoint=control_endpoint,
        fpm_endpoint=fpm_endpoint,
        rank=rank,
        all_ranks=all_ranks,
        count=count,
        duration=duration,
        timeout=timeout,
    )
    _run(json_lines, lambda out: tool.fpm(options, out))


@app.command("stats")
def stats(
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Show the daemon's per-rank counters: KV blocks, requests, preemptions, pass lateness."""
    from engined.tools import stats as tool

    _run(json_lines, lambda out: tool.stats(control_endpoint, timeout, out))


@app.command("bench")
def bench(
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency",
            min=1,
            help="Closed loop: requests kept in flight (default 8 unless --rate).",
            show_default=False,
            rich_help_panel=_LOAD,
        ),
    ] = None,
    rate: Annotated[
        float | None,
        typer.Option(
            "--rate",
            parser=_seconds,
            metavar="PER_S",
            help="Open loop: Poisson arrivals per second (seeded).",
            show_default=False,
            rich_help_panel=_LOAD,
        ),
    ] = None,
    requests: Annotated[
        int | None,
        typer.Option(
            "--requests",
            min=1,
            metavar="N",
            help="Requests to send (default 100 unless --duration; with both, the first limit).",
            show_default=False,
            rich_help_panel=_LOAD,
        ),
    ] = None,
    duration: Annotated[
        float | None,
        typer.Option(
            "--duration",
            parser=_seconds,
            metavar="SECONDS",
            help="Stop starting requests after this many seconds (in-flight ones finish).",
            show_default=False,
            rich_help_panel=_LOAD,
        ),
    ] = None,
    prompt_len: Annotated[
        Distribution,
        typer.Option(
            "--prompt-len",
            parser=_distribution,
            metavar="DIST",
            help="Prompt lengths: fixed:N, uniform:LO:HI or normal:MEAN:STD.",
            rich_help_panel=_LOAD,
        ),
    ] = DEFAULT_PROMPT_LEN,
    output_len: Annotated[
        Distribution,
        typer.Option(
            "--output-len",
            parser=_distribution,
            metavar="DIST",
            help="Output lengths (max_tokens), same syntax.",
            rich_help_panel=_LOAD,
        ),
    ] = DEFAULT_OUTPUT_LEN,
    shared_prefix_ratio: Annotated[
        float,
        typer.Option(
            "--shared-prefix-ratio",
            min=0.0,
            max=1.0,
            help="Fraction of each prompt taken from one of the shared prefixes.",
            rich_help_panel=_LOAD,
        ),
    ] = 0.0,
    prefix_groups: Annotated[
        int,
        typer.Option(
            "--prefix-groups",
            min=1,
            metavar="K",
            help="Number of distinct shared prefixes.",
            rich_help_panel=_LOAD,
        ),
    ] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Seed of prompts, lengths and arrivals.")] = 0,
    speedup_ratio: Annotated[
        float,
        typer.Option(
            "--speedup-ratio",
            parser=_seconds,
            metavar="RATIO",
            help="The daemon's --speedup-ratio: latencies are reported as wall x RATIO "
            "(modeled time).",
        ),
    ] = 1.0,
    dp_rank: Annotated[
        int | None,
        typer.Option("--dp-rank", min=0, help="Send every request to this rank."),
    ] = None,
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            parser=_seconds,
            metavar="SECONDS",
            help="How long a request may wait for each reply or output before it fails.",
            rich_help_panel=_CONNECTION,
        ),
    ] = 60.0,
    json_lines: JsonLines = False,
) -> None:
    """Generate load and report throughput, TTFT/ITL/e2e percentiles, prefix hits, preemptions.

    Latencies are in modeled time (wall x --speedup-ratio); throughput
    is wall time. Exit status 1 only when no request completed (failures
    are counted in the report).
    """
    from engined.tools import bench as tool

    if concurrency is not None and rate is not None:
        raise typer.BadParameter(
            "give either --concurrency (closed loop) or --rate (open loop), not both",
            param_hint="'--rate'",
        )
    options = tool.BenchOptions(
        control_endpoint=control_endpoint,
        concurrency=concurrency,
        rate=rate,
        requests=requests,
        duration=duration,
        prompt_len=prompt_len,
        output_len=output_len,
        shared_prefix_ratio=shared_prefix_ratio,
        prefix_groups=prefix_groups,
        seed=seed,
        speedup_ratio=speedup_ratio,
        dp_rank=dp_rank,
        timeout=timeout,
    )
    _run(json_lines, lambda out: tool.bench(options, out))


@app.command(
    "dynamo-worker",
    context_settings={"allow_extra_args": True, "ignore_unknown_options": True},
    add_help_option=False,
)
def dynamo_worker(ctx: typer.Context) -> None:
    """Serve an engined daemon behind NVIDIA Dynamo (needs engined[dynamo]; --help for flags).

    The flags are Dynamo's own workers' (--model-path, --served-model-name,
    --disaggregation-mode, --namespace, --component, --endpoint, --discovery-backend,
    --request-plane, --event-plane), plus --control-endpoint.
    """
    # NOTE: the worker parses its own flags with argparse, as Dynamo's workers do, so this
    # command only passes them on; `python -m engined.dynamo` is the same program.
    from engined.dynamo.worker import main as worker_main

    raise typer.Exit(worker_main(ctx.args))


def main() -> None:
    """Entry point of the `engined` console script and of `python -m engined`."""
    app(prog_name="engined")


if __name__ == "__main__":
    main()
