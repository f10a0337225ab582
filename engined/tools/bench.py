"""`engined bench`: a load generator and its report.

Two load shapes, because they answer different questions:

* closed loop (`--concurrency C`): C requests always in flight, a new one as soon as one
  finishes; measures capacity at a fixed parallelism.
* open loop (`--rate R`): Poisson arrivals at R requests/s whatever the daemon does, as real
  traffic arrives; shows queueing when R exceeds capacity.

Prompts and output lengths are drawn from seeded distributions (`engined.tools.distributions`),
and `--shared-prefix-ratio` makes that fraction of every prompt the start of one of
`--prefix-groups` shared prefixes, so prefix caching (and KV events) get exercised as a
system prompt would. The same seed and options give the same requests in the same order.

Latencies are measured at the client in wall time and reported in **modeled** time:
`modeled = wall x --speedup-ratio`, where the ratio must be the daemon's own
`--speedup-ratio` (the protocol does not announce it). A daemon at speedup 0 has no modeled
wall clock; bench it with `--speedup-ratio 1` to read its latencies as wall time. Throughput is
wall time. Preemptions are the difference of the daemon's counters before and after the run,
so other clients' load counts too.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any, Final, Literal

from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from engined.client import ClientClosedError, EngineClient, EngineError
from engined.tools.args import DEFAULT_TIMEOUT
from engined.tools.common import (
    EXIT_FAILURE,
    EXIT_OK,
    Output,
    ToolError,
    UsageError,
    control_client,
    table_text,
    zmq_context,
)
from engined.tools.distributions import DEFAULT_OUTPUT_LEN, DEFAULT_PROMPT_LEN, Distribution
from engined.tools.stats import fetch_stats
from engined.tools.submit import VOCAB_SIZE

DEFAULT_CONCURRENCY: Final = 8
DEFAULT_REQUESTS: Final = 100
_CANCEL_TIMEOUT_S: Final = 2.0


@dataclass(frozen=True, slots=True)
class BenchOptions:
    control_endpoint: str
    concurrency: int | None = None
    rate: float | None = None
    requests: int | None = None
    duration: float | None = None
    prompt_len: Distribution = DEFAULT_PROMPT_LEN
    output_len: Distribution = DEFAULT_OUTPUT_LEN
    shared_prefix_ratio: float = 0.0
    prefix_groups: int = 1
    seed: int = 0
    speedup_ratio: float = 1.0
    dp_rank: int | None = None
    timeout: float = 60.0


# --- workload -------------------------------------------------------------------------------


class Workload:
    """The request sequence: prompt tokens and max_tokens, reproducible from the seed.

    A request's shared part is the first `round(ratio * prompt_len)` tokens of its group's
    prefix; groups are one long token sequence each, so prompts of different lengths in one
    group share the common start, as prompts sharing a system prompt do. The rest is random.
    """

    def __init__(
        self,
        prompt_len: Distribution,
        output_len: Distribution,
        shared_prefix_ratio: float,
        prefix_groups: int,
        seed: int,
        vocab_size: int = VOCAB_SIZE,
    ) -> None:
        self._prompt_len = prompt_len
        self._output_len = output_len
        self._ratio = shared_prefix_ratio
        self._vocab = vocab_size
        self._rng = random.Random(f"engined-bench-{seed}")
        self._groups = [
            random.Random(f"engined-bench-{seed}-prefix-{g}") for g in range(prefix_groups)
        ]
        self._prefixes: list[list[int]] = [[] for _ in range(prefix_groups)]

    def next(self) -> tuple[list[int], int]:
        rng = self._rng
        length = self._prompt_len.sample(rng)
        max_tokens = self._output_len.sample(rng)
        shared = min(length, round(length * self._ratio))
        group = rng.randrange(len(self._groups))
        prefix = self._prefix(group, shared)
        return prefix + [rng.randrange(self._vocab) for _ in range(length - shared)], max_tokens

    def _prefix(self, group: int, length: int) -> list[int]:
        tokens = self._prefixes[group]
        grow = self._groups[group]
        while len(tokens) < length:
            tokens.append(grow.randrange(self._vocab))
        return tokens[:length]


# --- running --------------------------------------------------------------------------------


@dataclass(slots=True)
class RequestResult:
    """One request as the client saw it (wall seconds)."""

    prompt_tokens: int
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    e2e_s: float | None = None
    finish_reason: str | None = None
    # None when the request completed; else the error code, `rejected` or `timeout`.
    error: str | None = None


RunOne = Callable[[int, list[int], int], Awaitable[RequestResult]]


async def run_request(
    client: EngineClient,
    request_id: str,
    prompt: list[int],
    max_tokens: int,
    *,
    dp_rank: int | None,
    timeout: float,
) -> RequestResult:
    """Submit one request and time its outputs; failures become `error`, never exceptions.

    Times are taken when the client hands an entry over, so they include the client's own
    queueing; at high load that is part of what a real client would see too.
    """
    result = RequestResult(prompt_tokens=len(prompt))
    start = time.perf_counter()
    try:
        await client.submit(
            prompt, max_tokens, request_id=request_id, dp_rank=dp_rank, timeout=timeout
        )
        last: float | None = None
        first = True
        async for entry in client.outputs(request_id, timeout=timeout):
            now = time.perf_counter()
            if first and entry.cached_tokens is not None:
                result.cached_tokens = entry.cached_tokens
            first = False
            if entry.token_ids:
                if last is None:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                result.output_tokens += len(entry.token_ids)
            result.finish_reason = entry.finish_reason
        result.e2e_s = time.perf_counter() - start
        if result.finish_reason != "length":
            result.error = result.finish_reason or "cancelled"
    except EngineError as error:
        result.error = error.code
    except TimeoutError:
        result.error = "timeout"
        with contextlib.suppress(Exception):
            await client.cancel(request_id, timeout=_CANCEL_TIMEOUT_S)
    return result


async def closed_loop(
    run_one: RunOne,
    workload: Workload,
    concurrency: int,
    limit: int | None,
    deadline: float | None,
    done: Callable[[RequestResult], None],
) -> list[RequestResult]:
    """`concurrency` workers, each starting its next request when the last one finished."""
    results: list[RequestResult] = []
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while (limit is None or issued < limit) and (
            deadline is None or time.perf_counter() < deadline
        ):
            index = issued
            issued += 1
            prompt, max_tokens = workload.next()
            result = await run_one(index, prompt, max_tokens)
            results.append(result)
            done(result)

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return results


async def open_loop(
    run_one: RunOne,
    workload: Workload,
    rate: float,
    seed: int,
    limit: int | None,
    deadline: float | None,
    done: Callable[[RequestResult], None],
) -> list[RequestResult]:
    """Poisson arrivals at `rate`/s (seeded), each request started on time whatever is in flight."""
    arrivals = random.Random(f"engined-bench-{seed}-arrivals")
    tasks: list[asyncio.Task[RequestResult]] = []

    async def tracked(index: int, prompt: list[int], max_tokens: int) -> RequestResult:
        result = await run_one(index, prompt, max_tokens)
        done(result)
        return result

    next_at = time.perf_counter()
    try:
        while limit is None or len(tasks) < limit:
            next_at += arrivals.expovariate(rate)
            if deadline is not None and next_at >= deadline:
                break
            delay = next_at - time.perf_counter()
            if delay > 0:
                # Pacing the arrivals, not waiting for anything.
                await asyncio.sleep(delay)
            prompt, max_tokens = workload.next()
            tasks.append(asyncio.create_task(tracked(len(tasks), prompt, max_tokens)))
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


async def bench(options: BenchOptions, out: Output) -> int:
    """Run the load, then print the report; exit 1 only when no request completed."""
    if options.concurrency is not None and options.rate is not None:
        raise UsageError("--rate", "give either --concurrency (closed loop) or --rate (open loop)")
    concurrency = options.concurrency
    if options.rate is None and concurrency is None:
        concurrency = DEFAULT_CONCURRENCY
    limit = options.requests
    if limit is None and options.duration is None:
        limit = DEFAULT_REQUESTS
    workload = Workload(
        options.prompt_len,
        options.output_len,
        options.shared_prefix_ratio,
        options.prefix_groups,
        options.seed,
    )
    run_tag = uuid.uuid4().hex[:8]

    async with zmq_context() as ctx, control_client(ctx, options.control_endpoint) as client:

        def run_one(index: int, prompt: list[int], max_tokens: int) -> Awaitable[RequestResult]:
            return run_request(
                client,
                f"bench-{run_tag}-{index}",
                prompt,
                max_tokens,
                dp_rank=options.dp_rank,
                timeout=options.timeout,
            )

        # A daemon that does not answer this at once is not there: do not wait --timeout.
        probe_timeout = min(options.timeout, DEFAULT_TIMEOUT)
        before = await fetch_stats(client, options.control_endpoint, probe_timeout)
        with _ProgressBar(out, limit) as progress:
            start = time.perf_counter()
            deadline = None if options.duration is None else start + options.duration
            try:
                if concurrency is not None:
                    results = await closed_loop(
                        run_one, workload, concurrency, limit, deadline, progress.advance
                    )
                else:
                    assert options.rate is not None
                    results = await open_loop(
                        run_one,
                        workload,
                        options.rate,
                        options.seed,
                        limit,
                        deadline,
                        progress.advance,
                    )
            except ClientClosedError as error:
                # The client's reader failed: every further request would fail the same way.
                raise ToolError(f"lost the connection to the daemon: {error.__cause__!r}") from None
            wall_s = time.perf_counter() - start
        after = await fetch_stats(client, options.control_endpoint, options.timeout)

    preemptions = sum(r.preemptions_total for r in after.ranks) - sum(
        r.preemptions_total for r in before.ranks
    )
    report = make_report(
        options,
        results,
        wall_s,
        preemptions,
        mode="closed" if concurrency is not None else "open",
        concurrency=concurrency,
    )
    if out.json:
        out.record(report)
    else:
        _print_report(out, report)
    return EXIT_OK if report["requests"] > 0 else EXIT_FAILURE


# --- the report -----------------------------------------------------------------------------


def percentile(ordered: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) of sorted values, interpolated linearly (numpy's default)."""
    if not ordered:
        return None
    pos = (len(ordered) - 1) * q / 100.0
    low = math.floor(pos)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (pos - low)


def summarize(values: Sequence[float]) -> dict[str, float | None]:
    ordered = sorted(values)
    return {
        "mean": sum(ordered) / len(ordered) if ordered else None,
        "p50": percentile(ordered, 50),
        "p90": percentile(ordered, 90),
        "p99": percentile(ordered, 99),
        "max": ordered[-1] if ordered else None,
    }


def make_report(
    options: BenchOptions,
    results: Sequence[RequestResult],
    wall_s: float,
    preemptions: int,
    *,
    mode: Literal["closed", "open"],
    concurrency: int | None,
) -> dict[str, Any]:
    """The report's stable keys; latencies in modeled ms (wall x speedup ratio)."""
    ok = [r for r in results if r.error is None]
    errors = Counter(r.error for r in results if r.error is not None)
    to_ms = options.speedup_ratio * 1000.0
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached_tokens = sum(r.cached_tokens for r in ok)
    per_s = 1.0 / wall_s if wall_s > 0 else 0.0
    return {
        "mode": mode,
        "concurrency": concurrency,
        "rate": options.rate,
        "seed": options.seed,
        "prompt_len": str(options.prompt_len),
        "output_len": str(options.output_len),
        "shared_prefix_ratio": options.shared_prefix_ratio,
        "prefix_groups": options.prefix_groups,
        "speedup_ratio": options.speedup_ratio,
        "requests": len(ok),
        "failed": len(results) - len(ok),
        "errors": dict(sorted(errors.items())),
        "duration_s": wall_s,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": cached_tokens,
        "prefix_hit_rate": cached_tokens / prompt_tokens if prompt_tokens else None,
        "requests_per_s": len(ok) * per_s,
        "output_tokens_per_s": output_tokens * per_s,
        "preemptions": preemptions,
        "ttft_ms": summarize([r.ttft_s * to_ms for r in ok if r.ttft_s is not None]),
        "itl_ms": summarize([x * to_ms for r in ok for x in r.itl_s]),
        "e2e_ms": summarize([r.e2e_s * to_ms for r in ok if r.e2e_s is not None]),
    }


def _print_report(out: Output, report: dict[str, Any]) -> None:
    load = (
        f"closed loop, concurrency {report['concurrency']}"
        if report["mode"] == "closed"
        else f"open loop, {report['rate']:g} requests/s (Poisson)"
    )
    hit = report["prefix_hit_rate"]
    errors = ", ".join(f"{code} {n}" for code, n in report["errors"].items())
    summary = [
        ("load", load),
        (
            "workload",
            f"prompt {report['prompt_len']}, output {report['output_len']}, "
            f"shared prefix {report['shared_prefix_ratio']:g} "
            f"of {report['prefix_groups']} group(s)",
        ),
        (
            "requests",
            f"{report['requests']} completed, {report['failed']} failed"
            + (f" ({errors})" if errors else ""),
        ),
        ("duration", f"{report['duration_s']:.3f} s (wall)"),
        (
            "throughput",
            f"{report['requests_per_s']:.1f} requests/s, "
            f"{report['output_tokens_per_s']:.1f} output tokens/s (wall)",
        ),
        (
            "prefix hits",
            "-"
            if hit is None
            else f"{hit * 100.0:.1f}% ({report['cached_tokens']} of {report['prompt_tokens']} "
            "prompt tokens cached)",
        ),
        ("preemptions", str(report["preemptions"])),
    ]
    headers = ("latency (modeled ms)", "mean", "p50", "p90", "p99", "max")
    rows = [
        [name, *(_ms(report[key][stat]) for stat in ("mean", "p50", "p90", "p99", "max"))]
        for name, key in (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("e2e", "e2e_ms"))
    ]
    note = f"modeled = wall x speedup ratio {report['speedup_ratio']:g}"
    if out.console is not None:
        table = Table(show_header=False, title="engined bench", title_justify="left")
        table.add_column(style="bold")
        table.add_column()
        for name, value in summary:
            table.add_row(name, value)
        out.render(table)
        latency = Table(caption=note, caption_justify="left")
        for header in headers:
            latency.add_column(header, justify="left" if header == headers[0] else "right")
        for row in rows:
            latency.add_row(*row)
        out.render(latency)
        return
    width = max(len(name) for name, _ in summary)
    for name, value in summary:
        out.line(f"{name.ljust(width)}  {value}")
    for line in table_text(headers, rows):
        out.line(line)
    out.line(f"({note})")


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


class _ProgressBar:
    """A rich progress bar on stderr when it is a terminal; nothing otherwise."""

    def __init__(self, out: Output, total: int | None) -> None:
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._failed = 0
        if out.stderr_is_tty:
            self._progress = Progress(
                TextColumn("[bold]bench"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[failed]} failed"),
                TimeElapsedColumn(),
                console=out.stderr_console(),
                transient=True,
            )
            self._task = self._progress.add_task("requests", total=total, failed=0, start=True)

    def __enter__(self) -> _ProgressBar:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._progress is not None:
            self._progress.stop()

    def advance(self, result: RequestResult) -> None:
        if self._progress is None or self._task is None:
            return
        if result.error is not None:
            self._failed += 1
        self._progress.update(self._task, advance=1, failed=self._failed)
