"""The operator commands: submit, events, fpm, stats, bench.

Each turns its options into the options dataclass of its module in `engined.tools` and runs
it there. The tools are imported inside the commands, so `serve` and `--help` never load
them (nor ZeroMQ or rich).
"""

from __future__ import annotations

from typing import Annotated, Literal

import typer

from engined.cli.tool_options import (
    CONNECTION_PANEL,
    LOAD_PANEL,
    OUTPUT_PANEL,
    ControlEndpoint,
    Count,
    Duration,
    JsonLines,
    Rank,
    Timeout,
    checked_distribution,
    checked_endpoint,
    checked_seconds,
    run_command,
)
from engined.tools.distributions import (
    DEFAULT_OUTPUT_LEN,
    DEFAULT_PROMPT_LEN,
    Distribution,
)
from engined.tools.option_values import (
    DEFAULT_CONTROL_ENDPOINT,
    DEFAULT_TIMEOUT,
    parse_token_list,
)


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
    run_command(json_lines, lambda out: tool.submit(options, out))


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
            rich_help_panel=OUTPUT_PANEL,
        ),
    ] = None,
    kv_events_endpoint: Annotated[
        str | None,
        typer.Option(
            "--kv-events-endpoint",
            parser=checked_endpoint,
            metavar="ENDPOINT",
            help="Subscribe here instead of asking the daemon (any vLLM publisher works).",
            rich_help_panel=CONNECTION_PANEL,
        ),
    ] = None,
    kv_replay_endpoint: Annotated[
        str | None,
        typer.Option(
            "--kv-replay-endpoint",
            parser=checked_endpoint,
            metavar="ENDPOINT",
            help="Replay socket to use instead of the daemon's.",
            rich_help_panel=CONNECTION_PANEL,
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
    run_command(json_lines, lambda out: tool.events(options, out))


def fpm(
    rank: Rank = 0,
    all_ranks: Annotated[
        bool,
        typer.Option("--all-ranks", help="Watch every rank.", rich_help_panel=CONNECTION_PANEL),
    ] = False,
    count: Count = None,
    duration: Duration = None,
    fpm_endpoint: Annotated[
        str | None,
        typer.Option(
            "--fpm-endpoint",
            parser=checked_endpoint,
            metavar="ENDPOINT",
            help="Subscribe here instead of asking the daemon.",
            rich_help_panel=CONNECTION_PANEL,
        ),
    ] = None,
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Watch forward-pass metrics: a live table on a terminal, one line per pass otherwise."""
    from engined.tools import fpm_watch as tool

    options = tool.FpmOptions(
        control_endpoint=control_endpoint,
        fpm_endpoint=fpm_endpoint,
        rank=rank,
        all_ranks=all_ranks,
        count=count,
        duration=duration,
        timeout=timeout,
    )
    run_command(json_lines, lambda out: tool.fpm(options, out))


def stats(
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Timeout = DEFAULT_TIMEOUT,
    json_lines: JsonLines = False,
) -> None:
    """Show the daemon's per-rank counters: KV blocks, requests, preemptions, pass lateness."""
    from engined.tools import stats as tool

    run_command(json_lines, lambda out: tool.stats(control_endpoint, timeout, out))


def bench(
    concurrency: Annotated[
        int | None,
        typer.Option(
            "--concurrency",
            min=1,
            help="Closed loop: requests kept in flight (default 8 unless --rate).",
            show_default=False,
            rich_help_panel=LOAD_PANEL,
        ),
    ] = None,
    rate: Annotated[
        float | None,
        typer.Option(
            "--rate",
            parser=checked_seconds,
            metavar="PER_S",
            help="Open loop: Poisson arrivals per second (seeded).",
            show_default=False,
            rich_help_panel=LOAD_PANEL,
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
            rich_help_panel=LOAD_PANEL,
        ),
    ] = None,
    duration: Annotated[
        float | None,
        typer.Option(
            "--duration",
            parser=checked_seconds,
            metavar="SECONDS",
            help="Stop starting requests after this many seconds (in-flight ones finish).",
            show_default=False,
            rich_help_panel=LOAD_PANEL,
        ),
    ] = None,
    prompt_len: Annotated[
        Distribution,
        typer.Option(
            "--prompt-len",
            parser=checked_distribution,
            metavar="DIST",
            help="Prompt lengths: fixed:N, uniform:LO:HI or normal:MEAN:STD.",
            rich_help_panel=LOAD_PANEL,
        ),
    ] = DEFAULT_PROMPT_LEN,
    output_len: Annotated[
        Distribution,
        typer.Option(
            "--output-len",
            parser=checked_distribution,
            metavar="DIST",
            help="Output lengths (max_tokens), same syntax.",
            rich_help_panel=LOAD_PANEL,
        ),
    ] = DEFAULT_OUTPUT_LEN,
    shared_prefix_ratio: Annotated[
        float,
        typer.Option(
            "--shared-prefix-ratio",
            min=0.0,
            max=1.0,
            help="Fraction of each prompt taken from one of the shared prefixes.",
            rich_help_panel=LOAD_PANEL,
        ),
    ] = 0.0,
    prefix_groups: Annotated[
        int,
        typer.Option(
            "--prefix-groups",
            min=1,
            metavar="K",
            help="Number of distinct shared prefixes.",
            rich_help_panel=LOAD_PANEL,
        ),
    ] = 1,
    seed: Annotated[int, typer.Option("--seed", help="Seed of prompts, lengths and arrivals.")] = 0,
    speedup_ratio: Annotated[
        float | None,
        typer.Option(
            "--speedup-ratio",
            parser=checked_seconds,
            metavar="RATIO",
            help="Latencies are reported as wall x RATIO (modeled time); default: the "
            "speedup the daemon announces (1 at speedup 0).",
        ),
    ] = None,
    dp_rank: Annotated[
        int | None,
        typer.Option("--dp-rank", min=0, help="Send every request to this rank."),
    ] = None,
    control_endpoint: ControlEndpoint = DEFAULT_CONTROL_ENDPOINT,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout",
            parser=checked_seconds,
            metavar="SECONDS",
            help="How long a request may wait for each reply or output before it fails.",
            rich_help_panel=CONNECTION_PANEL,
        ),
    ] = 60.0,
    json_lines: JsonLines = False,
) -> None:
    """Generate load and report throughput, TTFT/ITL/e2e percentiles, prefix hits, preemptions.

    Latencies are in modeled time (wall x the daemon's speedup); throughput
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
    run_command(json_lines, lambda out: tool.bench(options, out))
