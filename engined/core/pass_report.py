"""What a pass tells the daemon's observers, wherever its rank runs.

A `PassResult` holds things only the rank's own process uses: the KV events and the FPM
snapshot its publishers send, the lifecycle events its delivery routes, the trace of a
recording engine. Observers (the Prometheus tallies, the load watch) see the rank from the
daemon, where a rank in a worker process has none of those; so they are given this narrower
value, every field of which means the same in both layouts (in process, it is taken from
the `PassResult`; from a worker, it arrives as it was taken there).
"""

from __future__ import annotations

import msgspec

from engined.core.kv_residency import KvBlockEviction
from engined.core.types import (
    Admission,
    Decodes,
    EndedRequest,
    EngineMetrics,
    PassResult,
    RequestOutput,
)


class PassReport(msgspec.Struct, frozen=True, gc=False, array_like=True):
    """One pass that changed something; each field is the `PassResult` field of its name."""

    end_ms: float
    outputs: list[RequestOutput]
    decodes: Decodes
    ended: list[EndedRequest]
    admissions: list[Admission]
    metrics: EngineMetrics
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    accept_length_output_tokens: int = 0
    accept_length_decode_forwards: int = 0
    kv_block_evictions: list[KvBlockEviction] = []
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []

    @classmethod
    def of(cls, result: PassResult) -> PassReport:
        return cls(
            end_ms=result.end_ms,
            outputs=result.outputs,
            decodes=result.decodes,
            ended=result.ended,
            admissions=result.admissions,
            metrics=result.metrics,
            prefix_cache_queries=result.prefix_cache_queries,
            prefix_cache_hits=result.prefix_cache_hits,
            accept_length_output_tokens=result.accept_length_output_tokens,
            accept_length_decode_forwards=result.accept_length_decode_forwards,
            kv_block_evictions=result.kv_block_evictions,
            spec_drafts=result.spec_drafts,
            spec_draft_tokens=result.spec_draft_tokens,
            spec_accepted_tokens=result.spec_accepted_tokens,
            spec_accepted_per_pos=result.spec_accepted_per_pos,
        )
