"""A sampled KV block's residency, as the core reports it (`kv_cache_metrics`).

Apart from types.py, which would outgrow its bound, like pass_trace.py: a value of
`PassResult` that only one setting produces (engined/core/paged/residency.py samples).
"""

from __future__ import annotations

import msgspec


class KvBlockEviction(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One sampled KV block's residency, reported when its slot was taken again (vLLM's
    `KVCacheEvictionEvent` under `--kv-cache-metrics`), in core milliseconds: from its
    allocation, from its last prefix hit (its allocation when none), and between its last
    (up to four) prefix hits."""

    lifetime_ms: float
    idle_ms: float
    reuse_gaps_ms: tuple[float, ...]
