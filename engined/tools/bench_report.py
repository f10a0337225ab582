"""The report of `engined bench`: stable JSON keys, and the same figures as tables.

Latencies are reported in modeled milliseconds (wall x the daemon's speedup ratio, see
`engined.tools.bench`). A run that ended early (the daemon went away, Ctrl-C) reports what
it measured until then, with `aborted` saying why and `abandoned` the requests still in
flight, whose latencies are unknown and which count in neither `requests` nor `failed`.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any, Literal

from rich.table import Table

from engined.model_clock import ModelClock
from engined.tools.bench_types import BenchOptions, RequestResult
from engined.tools.common import Output, table_text

Aborted = Literal["daemon_gone", "interrupted"]


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
    preemptions: int | None,
    *,
    mode: Literal["closed", "open"],
    concurrency: int | None,
    aborted: Aborted | None = None,
    abandoned: int = 0,
) -> dict[str, Any]:
    """The report's stable keys; latencies in modeled ms (wall x speedup ratio).

    `preemptions` is None when the daemon could not be asked after the run.
    """
    ok = [r for r in results if r.error is None]
    errors = Counter(r.error for r in results if r.error is not None)
    # A daemon at speedup 0 has no modelled clock: its latencies are reported as wall time.
    to_ms = ModelClock(options.speedup_ratio or 1.0).to_modelled_ms(1.0)
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
        "aborted": aborted,
        "abandoned": abandoned,
        "ttft_ms": summarize([r.ttft_s * to_ms for r in ok if r.ttft_s is not None]),
        "itl_ms": summarize([x * to_ms for r in ok for x in r.itl_s]),
        "e2e_ms": summarize([r.e2e_s * to_ms for r in ok if r.e2e_s is not None]),
    }


def print_report(out: Output, report: dict[str, Any]) -> None:
    """The report as JSON (one record), a rich table, or plain lines."""
    if out.json:
        out.record(report)
    else:
        _print_tables(out, report)


def _print_tables(out: Output, report: dict[str, Any]) -> None:
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
        ("preemptions", "-" if report["preemptions"] is None else str(report["preemptions"])),
    ]
    if report["aborted"] is not None:
        why = "the daemon stopped answering" if report["aborted"] == "daemon_gone" else "Ctrl-C"
        summary.append(
            ("aborted", f"{why}; {report['abandoned']} request(s) in flight not measured")
        )
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
