"""`engined stats`: one `stats` request, shown as a row per data-parallel rank.

The quickest look at a running daemon: KV blocks in use and cached, running and waiting
requests, preemptions and passes so far, and how late paced passes start. JSON mode prints one
object per rank with the protocol's own keys (`RankStats`), so scripts can diff two snapshots.
"""

from __future__ import annotations

from typing import Any

import msgspec
from rich import box
from rich.table import Table

from engined.client import EngineClient, EngineError
from engined.tools.common import (
    EXIT_OK,
    Output,
    control_client,
    engine_failure,
    no_answer,
    table_text,
    zmq_context,
)
from engined.wire.control import RankStats, StatsReply

_HEADERS = (
    "rank",
    "active",
    "inactive",
    "total",
    "usage",
    "running",
    "waiting",
    "preemptions",
    "passes",
    "late p50 ms",
    "late p99 ms",
    "late max ms",
)
# The same, folded on two lines for a terminal table (twelve columns fit 80 columns then).
_RICH_HEADERS = (
    "rank",
    "active\nblocks",
    "cached\nblocks",
    "total\nblocks",
    "KV\nusage",
    "run-\nning",
    "wait-\ning",
    "preempt\n-ions",
    "passes",
    "late\np50 ms",
    "late\np99 ms",
    "late\nmax ms",
)


async def fetch_stats(client: EngineClient, endpoint: str, timeout: float) -> StatsReply:
    """The daemon's `stats` reply, failures as ToolError (shared with `bench`)."""
    try:
        return await client.stats(timeout=timeout)
    except TimeoutError:
        raise no_answer(endpoint, timeout) from None
    except EngineError as error:
        raise engine_failure(error) from None


async def stats(control_endpoint: str, timeout: float, out: Output) -> int:
    async with zmq_context() as ctx, control_client(ctx, control_endpoint) as client:
        reply = await fetch_stats(client, control_endpoint, timeout)
    if out.json:
        for rank in reply.ranks:
            out.record(rank_record(rank))
        return EXIT_OK
    rows = [_row(rank) for rank in reply.ranks]
    tiers = tier_rows(reply.ranks)
    if out.console is not None:
        table = Table(
            title=f"engined at {control_endpoint}",
            title_justify="left",
            box=box.SIMPLE_HEAD,
            padding=0,
            show_edge=False,
        )
        for header in _RICH_HEADERS:
            table.add_column(header, justify="left" if header == "rank" else "right")
        for row in rows:
            table.add_row(*row)
        out.render(table)
        if tiers:
            tier_table = Table(box=box.SIMPLE_HEAD, padding=0, show_edge=False)
            for header in _TIER_HEADERS:
                tier_table.add_column(header, justify="left" if header == "rank" else "right")
            for row in tiers:
                tier_table.add_row(*row)
            out.render(tier_table)
    else:
        for line in table_text(_HEADERS, rows):
            out.line(line)
        if tiers:
            for line in table_text(_TIER_HEADERS, tiers):
                out.line(line)
    return EXIT_OK


_TIER_HEADERS = (
    "rank",
    "G2 held",
    "G2 cached",
    "G2 total",
    "G3 held",
    "G3 cached",
    "G3 total",
)


def tier_rows(ranks: list[RankStats]) -> list[list[str]]:
    """Host (G2) and disk (G3) tier blocks per rank; empty when no rank has a tier."""
    if not any(r.g2_total_blocks or r.g3_total_blocks for r in ranks):
        return []
    return [
        [
            str(r.dp_rank),
            str(r.g2_active_blocks),
            str(r.g2_inactive_blocks),
            str(r.g2_total_blocks),
            str(r.g3_active_blocks),
            str(r.g3_inactive_blocks),
            str(r.g3_total_blocks),
        ]
        for r in ranks
    ]


def rank_record(rank: RankStats) -> dict[str, Any]:
    record: dict[str, Any] = msgspec.to_builtins(rank)
    return record


def _row(r: RankStats) -> list[str]:
    return [
        str(r.dp_rank),
        str(r.active_blocks),
        str(r.inactive_blocks),
        str(r.total_blocks),
        f"{r.kv_cache_usage * 100.0:.1f}%",
        str(r.running),
        str(r.waiting),
        str(r.preemptions_total),
        str(r.passes_total),
        f"{r.lateness_p50_ms:.3f}",
        f"{r.lateness_p99_ms:.3f}",
        f"{r.lateness_max_ms:.3f}",
    ]
