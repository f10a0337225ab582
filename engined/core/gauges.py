"""A rank's gauges as the core reports them: per pass (`FpmSnapshot`, Dynamo's forward-pass
metrics) and on demand (`EngineMetrics`, its load).

Apart from types.py (which re-exports them): the daemon's metrics, load and FPM publishers
read these and nothing else of the core's values.
"""

from __future__ import annotations

import msgspec


class FpmSnapshot(msgspec.Struct, frozen=True, gc=False):
    """Forward-pass metrics of one pass (Dynamo's `ForwardPassSnapshot`).

    Variances are population variances, exact and rounded once (engined/core/fpm.py).
    Scheduled prefills are measured over the full prompt length, queued decodes over the
    tokens whose KV they will need.
    """

    num_prefill_requests: int = 0
    sum_prefill_tokens: int = 0
    var_prefill_length: float = 0.0
    sum_prefill_kv_tokens: int = 0
    num_decode_requests: int = 0
    sum_decode_kv_tokens: int = 0
    var_decode_kv_tokens: float = 0.0
    num_queued_prefill: int = 0
    sum_queued_prefill_tokens: int = 0
    var_queued_prefill_length: float = 0.0
    num_queued_decode: int = 0
    sum_queued_decode_kv_tokens: int = 0
    var_queued_decode_kv_tokens: float = 0.0
    wall_time_secs: float = 0.0


class EngineMetrics(msgspec.Struct, frozen=True, gc=False):
    """Load gauges of one rank (Dynamo's `MockerMetrics`, plus the inactive pool size)."""

    dp_rank: int
    active_blocks: int
    inactive_blocks: int
    total_blocks: int
    kv_cache_usage: float
    running: int
    waiting: int
    preemptions_total: int
    # Lower tiers (zero without them): G2 host and G3 disk pools, as the G1 fields above.
    g2_active_blocks: int = 0
    g2_inactive_blocks: int = 0
    g2_total_blocks: int = 0
    g3_active_blocks: int = 0
    g3_inactive_blocks: int = 0
    g3_total_blocks: int = 0
    # Of `waiting`, those deferred rather than waiting on capacity (vLLM's deferred waiting):
    # reserved destinations awaiting their transfer, requests parked on an onboard, and
    # requests an admission scan passed over (a LoRA adapter beyond `max_loras`).
    waiting_deferred: int = 0
    # Of those, the ones blocked on a KV load (vLLM's WAITING_FOR_REMOTE_KVS and its offload
    # loads): a P/D destination's `kv_fetch` stage `in_progress`.
    waiting_for_kv: int = 0
    # vLLM's pause and sleep (engined/core/pausing.py): the scheduler's `PauseState` value,
    # whether a pause waits for the engine to go idle to complete, whether new requests are
    # to be refused (`reject_new_requests`), the executor's sleeping pools, and the sleep
    # state vLLM's frontend records (`record_sleep_state(asleep, sleep_level)`).
    pause_state: int = 0
    pause_pending: bool = False
    rejecting: bool = False
    sleeping_tags: tuple[str, ...] = ()
    asleep: bool = False
    sleep_level: int = 0
