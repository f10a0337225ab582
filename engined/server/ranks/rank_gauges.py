"""`RankGauges`: what the daemon reads of a rank between commands, in one snapshot.

The same Struct whether the rank runs in the daemon's loop (read from its `EngineLoop` as it
is now) or in a worker process (as its worker last reported, or asked for): `stats`, the
`/metrics` scrape, the systemd status line, the idle heap trim and the load watch read this,
never the engine, so none of them learns where the rank runs.
"""

from __future__ import annotations

import msgspec

from engined.core.types import EngineMetrics


class RankGauges(msgspec.Struct, frozen=True, gc=False):
    metrics: EngineMetrics
    passes_total: int
    # Output tokens delivered (`accept_length_output_tokens` summed over passes).
    tokens_total: int
    # KV event sends some slow subscriber missed (its queue's byte budget was full).
    kv_overflows: int
    # p50, p99 and max of pass-start lateness in ms (zeros before any paced pass).
    lateness_ms: tuple[float, float, float]
