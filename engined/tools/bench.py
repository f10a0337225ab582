"""`engined bench`: a load generator and its report.

Two load shapes, because they answer different questions:

* closed loop (`--concurrency C`): C requests always in flight, a new one as soon as one
  finishes; measures capacity at a fixed parallelism.
* open loop (`--rate R`): Poisson arrivals at R requests/s whatever the daemon does, as real
  traffic arrives; shows queueing when R exceeds capacity.

Prompts and output lengths are drawn from seeded distributions (`engined.tools.distributions`),
and `--shared-prefix-ratio` makes that fraction of every prompt the start of one of
`--prefix-groups` shared prefixes, so prefix caching (and KV events) get exercised as a
system prompt would. The same seed and options give the same requests in the same order
(`engined.tools.bench_workload`).

Latencies are measured at the client in wall time and reported in **modeled** time:
`modeled = wall x ratio`, the ratio being the daemon's own speedup as its `welcome` announces
it, unless `--speedup-ratio` says otherwise. A daemon at speedup 0 has no modeled clock: its
latencies are reported as wall time (ratio 1). Throughput is
wall time. Preemptions are the difference of the daemon's counters before and after the run,
so other clients' load counts too.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
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

from engined.client import ClientClosedError, DaemonLost, EngineClient, EngineError
from engined.tools.bench_report import Aborted, make_report, print_report
from engined.tools.bench_types import BenchOptions as BenchOptions  # engined.cli reads it here
from engined.tools.bench_types import RequestResult
from engined.tools.bench_workload import Workload as Workload  # tests read it here
from engined.tools.common import (
    EXIT_FAILURE,
    EXIT_OK,
    Output,
    ToolError,
    UsageError,
    control_client,
    zmq_context,
)
from engined.tools.option_values import DEFAULT_TIMEOUT
from engined.tools.stats import fetch_stats

DEFAULT_CONCURRENCY: Final = 8
DEFAULT_REQUESTS: Final = 100
# Seconds between liveness pings while the load runs (each waits up to min(--timeout, 10 s)).
LIVENESS_INTERVAL_S: Final = 1.0
_CANCEL_TIMEOUT_S: Final = 2.0


# --- running --------------------------------------------------------------------------------


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
) -> None:
    """`concurrency` workers, each starting its next request when the last one finished."""
    issued = 0

    async def worker() -> None:
        nonlocal issued
        while (limit is None or issued < limit) and (
            deadline is None or time.perf_counter() < deadline
        ):
            index = issued
            issued += 1
            prompt, max_tokens = workload.next()
            done(await run_one(index, prompt, max_tokens))

    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def open_loop(
    run_one: RunOne,
    workload: Workload,
    rate: float,
    seed: int,
    limit: int | None,
    deadline: float | None,
    done: Callable[[RequestResult], None],
) -> None:
    """Poisson arrivals at `rate`/s (seeded), each request started on time whatever is in flight."""
    arrivals = random.Random(f"engined-bench-{seed}-arrivals")
    tasks: list[asyncio.Task[None]] = []

    async def tracked(index: int, prompt: list[int], max_tokens: int) -> None:
        done(await run_one(index, prompt, max_tokens))

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
        await asyncio.gather(*tasks)
    finally:
        for task in tasks:
            task.cancel()


async def watch_daemon(
    client: EngineClient,
    timeout: float,
    *,
    interval: float = LIVENESS_INTERVAL_S,
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
) -> None:
    """Return once the daemon stops answering `ping` within `timeout` (it is gone).

    A DEALER never learns that its peer went away, so without this every request in flight,
    and every one started after, would wait its whole --timeout: a vanished daemon took a
    run of 200 requests at --timeout 2 97 s to notice, one request after another.
    """
    while True:
        # Pacing the probes, not waiting for anything.
        await sleep(interval)
        try:
            await client.ping(timeout=timeout)
        except (TimeoutError, ClientClosedError):
            return


async def bench(options: BenchOptions, out: Output) -> int:
    """Run the load, then print the report; exit 1 when no request completed or the daemon
    went away (what was measured until then is reported), 130 on Ctrl-C (likewise)."""
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
    mode: Literal["closed", "open"] = "closed" if concurrency is not None else "open"
    results: list[RequestResult] = []
    started = 0

    async with zmq_context() as ctx, control_client(ctx, options.control_endpoint) as client:

        def run_one(index: int, prompt: list[int], max_tokens: int) -> Awaitable[RequestResult]:
            nonlocal started
            started += 1
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
        if options.speedup_ratio is None:
            welcome = await client.hello(timeout=probe_timeout)
            options = dataclasses.replace(options, speedup_ratio=welcome.speedup_ratio or 1.0)
        with _ProgressBar(out, limit) as progress:

            def done(result: RequestResult) -> None:
                results.append(result)
                progress.advance(result)

            start = time.perf_counter()
            deadline = None if options.duration is None else start + options.duration
            if concurrency is not None:
                load = closed_loop(run_one, workload, concurrency, limit, deadline, done)
            else:
                assert options.rate is not None
                load = open_loop(
                    run_one, workload, options.rate, options.seed, limit, deadline, done
                )

            def report(aborted: Aborted | None, preemptions: int | None) -> dict[str, Any]:
                return make_report(
                    options,
                    results,
                    time.perf_counter() - start,
                    preemptions,
                    mode=mode,
                    concurrency=concurrency,
                    aborted=aborted,
                    abandoned=started - len(results),
                )

            try:
                gone = await _until_done_or_gone(load, watch_daemon(client, probe_timeout))
            except asyncio.CancelledError:
                # Ctrl-C (asyncio.run cancels the main task): report what was measured.
                print_report(out, report("interrupted", None))
                raise
            except DaemonLost:
                # Noticed by the client's heartbeats before the probe: the same ending.
                gone = True
            except ClientClosedError as error:
                # The client's reader failed: every further request would fail the same way.
                raise ToolError(f"lost the connection to the daemon: {error.__cause__!r}") from None
        if gone:
            print_report(out, report("daemon_gone", None))
            raise ToolError(
                f"the daemon at {options.control_endpoint} stopped answering (no pong within "
                f"{probe_timeout:g} s); the report covers the run until then"
            )
        final = report(None, None)
        after = await fetch_stats(client, options.control_endpoint, options.timeout)
    final["preemptions"] = sum(r.preemptions_total for r in after.ranks) - sum(
        r.preemptions_total for r in before.ranks
    )
    print_report(out, final)
    return EXIT_OK if final["requests"] > 0 else EXIT_FAILURE


async def _until_done_or_gone(
    load: Coroutine[Any, Any, None], watch: Coroutine[Any, Any, None]
) -> bool:
    """Run the load while watching the daemon; True when the daemon went away first."""
    load_task = asyncio.ensure_future(load)
    watch_task = asyncio.ensure_future(watch)
    try:
        await asyncio.wait((load_task, watch_task), return_when=asyncio.FIRST_COMPLETED)
        if load_task.done():
            load_task.result()  # raises what the load raised
            return False
        return True
    finally:
        for task in (load_task, watch_task):
            task.cancel()
        await asyncio.gather(load_task, watch_task, return_exceptions=True)


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
